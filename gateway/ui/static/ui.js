// tokenbus dashboard: the overview's charts (uPlot) and a job's live tokens (server-sent events).
// No inline scripts (the Content-Security-Policy forbids them); htmx does the rest declaratively.
"use strict";

const SERIES = {
  depth: [["interactive", "#b3261e"], ["default", "#0b57d0"], ["bulk", "#146c2e"]],
  rates: [["jobs_s", "#0b57d0", "jobs / s"], ["tokens_s", "#7a4a00", "tokens / s"]],
};

function chartOpts(kind, width) {
  const series = [{}].concat(SERIES[kind].map(([key, stroke, label]) => ({
    label: label || key, stroke, width: 2, scale: key === "tokens_s" ? "tok" : "y",
  })));
  const axes = [{}, {scale: "y"}];
  if (kind === "rates") axes.push({scale: "tok", side: 1, grid: {show: false}});
  return {width, height: 220, series, axes, scales: {x: {time: true}}, legend: {live: false}};
}

function columns(kind, data) {
  return [data.t].concat(SERIES[kind].map(([key]) => data[key]));
}

function startCharts() {
  const nodes = document.querySelectorAll("[data-chart]");
  if (!nodes.length || typeof uPlot === "undefined") return;
  const charts = new Map();
  async function refresh() {
    let data;
    try {
      const resp = await fetch("/ui/api/series", {credentials: "same-origin"});
      if (resp.status === 401) { window.location = "/ui/login"; return; }
      data = await resp.json();
    } catch (err) { return; }
    nodes.forEach((node) => {
      const kind = node.dataset.chart;
      const cols = columns(kind, data);
      if (!charts.has(node)) {
        charts.set(node, new uPlot(chartOpts(kind, Math.max(300, node.clientWidth - 8)), cols, node));
      } else {
        charts.get(node).setData(cols);
      }
      node.dataset.points = String(data.t.length);
    });
  }
  refresh();
  setInterval(refresh, 2000);
}

function startTokens() {
  const out = document.getElementById("tokens");
  if (!out || !out.dataset.stream) return;
  const state = document.getElementById("tokens-state");
  const source = new EventSource(out.dataset.stream);
  source.addEventListener("token", (ev) => {
    out.textContent += JSON.parse(ev.data);
    out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
  });
  source.addEventListener("end", () => {
    source.close();
    out.dataset.done = "1";
    if (state) state.textContent = "The stream has ended (" + out.dataset.chunks + " chunks).";
  });
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED && state) state.textContent = "The stream was interrupted.";
  };
}

document.addEventListener("DOMContentLoaded", () => { startCharts(); startTokens(); });
