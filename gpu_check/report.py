"""gpu_check.md and gpu_check.json under the output folder, each row appended the moment it is measured (by the
stage process that measured it), so a stage killed at its cap, or a whole run cut short, keeps every row
measured before. The JSON file is rewritten whole (to a temporary file, then renamed) at each row: always
valid; the Markdown table grows one line at a time and gets its summary line at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path


def verdict(ok) -> str:
    return {True: "ok", False: "MISS", None: "-"}[ok]


def md_line(r: dict) -> str:
    return (f"| {r['stage']} | {r['check']} | {r['value']} | {r['reference']} | {verdict(r['ok'])} | "
            f"{str(r['note']).replace('|', '/')} |")


class Report:
    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.md = self.dir / "gpu_check.md"
        self.json = self.dir / "gpu_check.json"

    def start(self, title: str, summary: str, environment: dict, smoke: bool, rehearsal: bool) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.md.write_text("\n".join([title, "", summary, "", "| stage | check | result | target / reference | ok "
                                      "| note |", "|---|---|---|---|---|---|", ""]))
        self._write(dict(environment=environment, smoke=smoke, rehearsal=rehearsal, stage_seconds={}, rows=[]))

    def load(self) -> dict:
        return json.loads(self.json.read_text())

    def add(self, stage: str, row: dict) -> dict:
        row = dict(stage=stage, **row)
        with self.md.open("a") as f:
            f.write(md_line(row) + "\n")
        data = self.load()
        data["rows"].append(row)
        self._write(data)
        return row

    def stage_done(self, stage: str, seconds: float) -> None:
        data = self.load()
        data["stage_seconds"][stage] = round(seconds, 1)
        self._write(data)

    def finish(self) -> tuple[dict, int]:
        data = self.load()
        misses = sum(r["ok"] is False for r in data["rows"])
        with self.md.open("a") as f:
            f.write("\nStage seconds: " + ", ".join(f"{k} {v}" for k, v in data["stage_seconds"].items())
                    + f". Misses: {misses}.\n")
        return data, misses

    def _write(self, data: dict) -> None:
        tmp = self.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.json)
