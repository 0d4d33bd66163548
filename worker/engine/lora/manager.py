"""LoraManager: the adapters an engine knows, the few held in host memory, the fewer resident in device slots.

    registered   name -> path (and an id: the prefix-cache salt), checked once at registration (LoraError)
    host         up to max_cpu_loras adapters' weights read from disk, least recently used dropped first;
                 adapters of requests inside the engine are always held (so seating one never reads a file)
    slots        max_loras device slots, stacked per wrapped linear (LoraLinear.a / .b); a slot is pinned
                 while a running sequence uses it, and an unpinned one is reloaded least recently used first

The scheduler seats a sequence in its adapter's slot when the adapter is resident (it joins the slot's rows: no
load), else in an idle slot (a load: an empty slot first, then the least recently used one whose adapter no
waiting sequence asks for); leaving (finish, preemption, abort) unpins it (unseat). When no slot is idle, the
first sequence that needs one waits, and one pinned slot is kept draining for it (the one whose users end
soonest, by their tokens left): only the sequences already waiting for its adapter may still join it, so it
comes free within a bounded number of tokens, however many requests for its adapter keep arriving. Slot
loads and disk reads are counted.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
from torch import nn

from worker.engine.errors import InvalidRequest
from worker.engine.lora.adapter import LoraAdapter, load_adapter
from worker.engine.lora.layer import LoraLinear, LoraState
from worker.engine.lora.targets import lora_targets
from worker.engine.sequence import Sequence

log = structlog.get_logger("tokenbus.engine")
_ids = itertools.count(1)


@dataclass
class Registration:
    name: str
    path: str
    salt: bytes  # the prefix cache's seed for this adapter's blocks: unique per registration
    requests: int = 0  # requests inside the engine that use it


class LoraManager:
    def __init__(self, model: nn.Module, backend, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.dtype = dtype
        self.targets = lora_targets(model)
        self.state = LoraState(max_loras)
        backend.lora_state = self.state
        self.linears: dict[tuple[int, str], LoraLinear] = {}
        for key, target in self.targets.items():
            parent, attr = target.module_of(model)
            a = torch.zeros(max_loras, len(target.slices) * max_rank, target.in_features, dtype=dtype, device=device)
            b = torch.zeros(max_loras, target.out_features, max_rank, dtype=dtype, device=device)
            if device.type == "cpu":  # the C++ kernel's layout: b a view of bt [slots, rank, out] (csrc/cpu_lora.cpp)
                b = torch.zeros(max_loras, max_rank, target.out_features, dtype=dtype).transpose(1, 2)
            wrapped = LoraLinear(getattr(parent, attr), a, b, target.slices, self.state, backend)
            setattr(parent, attr, wrapped)
            self.linears[key] = wrapped
        self.registered: dict[str, Registration] = {}
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.slot_names: list[str | None] = [None] * max_loras
        self.slot_users = [0] * max_loras
        self.idle_slots: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU, unpinned
        self.draining: int | None = None  # the pinned slot no new sequence joins until it is idle (wait_for_slot)
        self.drain_joiners: set[Sequence] = set()  # those that were waiting for it when it began to drain
        self.loads = 0  # adapters copied into a slot
        self.disk_reads = 0  # adapters read from their directory (registration included)

    @classmethod
    def for_engine(cls, cfg, model: nn.Module, backend, model_path: str, dtype: torch.dtype, device: torch.device,
                   tp=None) -> LoraManager:
        """The slots an EngineConfig asks for (max_loras > 0), refusing what cannot take adapters."""
        if model_path != "native":
            raise ValueError(f"LoRA adapters (max_loras {cfg.max_loras}) need a native model family; {cfg.model!r} "
                             "runs on transformers' code (model_impl) and takes none")
        if tp is not None:
            raise ValueError("LoRA adapters with tensor_parallel_size > 1 are not supported yet (the slots are not "
                             "sharded): serve adapters on a single-GPU worker")
        return cls(model, backend, cfg.max_loras, cfg.max_cpu_loras or cfg.max_loras, cfg.max_lora_rank, dtype, device)

    # ---- registry ------------------------------------------------------------------------------------------

    def add(self, name: str, path: str) -> None:
        """Register (or replace, when no request uses it) adapter `name`; raises LoraError when it does not load."""
        old = self.registered.get(name)
        if old is not None and old.requests:
            raise InvalidRequest(f"LoRA adapter {name!r} is in use by {old.requests} requests: remove it once they end")
        adapter = self._read(name, path)
        if old is not None:
            self.remove(name)
        salt = hashlib.blake2b(f"lora:{next(_ids)}:{name}".encode(), digest_size=16).digest()
        self.registered[name] = Registration(name, path, salt)
        self._keep(adapter)
        log.info("lora_added", adapter=name, path=path, rank=adapter.rank, mib=round(adapter.nbytes / 2**20, 2))

    def remove(self, name: str) -> None:
        reg = self.registered.get(name)
        if reg is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r}; known: {sorted(self.registered)}")
        if reg.requests:
            raise InvalidRequest(f"LoRA adapter {name!r} is in use by {reg.requests} requests: remove it once they end")
        del self.registered[name]
        self.host.pop(name, None)
        if name in self.slot_names:
            self.slot_names[self.slot_names.index(name)] = None
        log.info("lora_removed", adapter=name)

    def names(self) -> list[str]:
        return list(self.registered)

    def stats(self) -> dict[str, int]:
        """EngineStats' LoRA counters."""
        return dict(lora_loads=self.loads, lora_disk_reads=self.disk_reads, loras_registered=len(self.registered),
                    loras_resident=sum(1 for n in self.slot_names if n is not None))

    # ---- requests ------------------------------------------------------------------------------------------

    def request_added(self, name: str) -> bytes:
        """A request for adapter `name` entered the engine: its weights are held in host memory until
        request_done. Returns the adapter's prefix-cache salt."""
        reg = self.registered.get(name)
        if reg is None:
            raise InvalidRequest(f"no LoRA adapter named {name!r}; this engine serves {sorted(self.registered)}",
                                 code="model_not_found")
        if name not in self.host:
            adapter = self._read(name, reg.path)  # LoraError: the file changed since its registration
            reg.requests += 1  # before _keep, which drops unheld adapters past max_cpu_loras
            self._keep(adapter)
        else:
            reg.requests += 1
            self.host.move_to_end(name)
        return reg.salt

    def request_done(self, name: str) -> None:
        reg = self.registered.get(name)
        if reg is not None:
            reg.requests -= 1
            self._trim_host()

    # ---- slots ---------------------------------------------------------------------------------------------

    def resident(self, name: str) -> bool:
        return name in self.slot_names

    def may_join(self, seq: Sequence) -> bool:
        """Whether seq, whose adapter is resident, may be seated now: not in a draining slot, unless it was
        already waiting when the slot began to drain."""
        return self.slot_names.index(seq.lora) != self.draining or seq in self.drain_joiners

    def wait_for_slot(self, running: list[Sequence], waiting) -> None:
        """A sequence needs a slot and none is idle: keep one pinned slot draining until it is idle, the one
        whose users have the fewest tokens left at most. Only the sequences of its adapter waiting now may still
        join it, newer ones may not; that bounds the wait."""
        if self.draining is not None or self.idle_slots:
            return
        left = [0] * self.max_loras
        for seq in running:
            if seq.lora_slot >= 0:
                left[seq.lora_slot] = max(left[seq.lora_slot], seq.max_num_tokens - len(seq.token_ids))
        self.draining = min(range(self.max_loras), key=lambda s: left[s])
        name = self.slot_names[self.draining]
        self.drain_joiners = {seq for seq in waiting if seq.lora == name}

    def seat(self, seq: Sequence, wanted: Callable[[], set[str]] = set) -> None:
        """Give seq its adapter's slot; a non-resident adapter is loaded into an idle slot: an empty one first,
        else the least recently used one whose adapter is not in wanted() (the adapters waiting sequences ask
        for: evicting one of those means loading it again soon), else the least recently used."""
        name = seq.lora
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        else:
            slot = next((s for s in self.idle_slots if self.slot_names[s] is None), None)
            if slot is None:
                keep = wanted() if len(self.idle_slots) > 1 else set()
                slot = next((s for s in self.idle_slots if self.slot_names[s] not in keep), next(iter(self.idle_slots)))
            self._load(slot, self.host[name])
        if self.slot_users[slot] == 0:
            del self.idle_slots[slot]
        self.slot_users[slot] += 1
        seq.lora_slot = slot

    def unseat(self, seq: Sequence) -> None:
        slot = seq.lora_slot
        if slot < 0:
            return
        seq.lora_slot = -1
        self.slot_users[slot] -= 1
        if self.slot_users[slot] == 0:
            self.idle_slots[slot] = None
            if slot == self.draining:
                self.draining, self.drain_joiners = None, set()  # free: the first one waiting for a slot takes it

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        # each part of the slot written once: the adapter's rows, zeros past its rank and for slices it leaves
        # alone (zeroing the whole slot first cost as much again, and a parallel region per call on the CPU)
        r = self.max_rank
        for key, linear in self.linears.items():
            pieces = adapter.pieces.get(key) or [None] * len(linear.slices)
            for j, piece in enumerate(pieces):
                offset, width = linear.slices[j]
                a_rows, b_cols = linear.a[slot, j * r : (j + 1) * r], linear.b[slot, offset : offset + width]
                rank = 0 if piece is None else piece[0].shape[0]
                if piece is not None:
                    a_rows[:rank].copy_(piece[0], non_blocking=True)
                    b_cols[:, :rank].copy_(piece[1], non_blocking=True)
                if rank < r:
                    a_rows[rank:].zero_()
                    b_cols[:, rank:].zero_()
        self.slot_names[slot] = adapter.name
        self.state.slot_ranks[slot] = adapter.rank
        self.loads += 1
        log.debug("lora_loaded", adapter=adapter.name, slot=slot, loads=self.loads)

    # ---- host memory ---------------------------------------------------------------------------------------

    def _read(self, name: str, path: str) -> LoraAdapter:
        self.disk_reads += 1
        return load_adapter(name, path, self.targets, self.max_rank, self.dtype)

    def _keep(self, adapter: LoraAdapter) -> None:
        self.host[adapter.name] = adapter
        self.host.move_to_end(adapter.name)
        self._trim_host()

    def _trim_host(self) -> None:
        """Drop the least recently used adapters no request holds while more than max_cpu_loras are kept."""
        for name in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                return
            reg = self.registered.get(name)
            if reg is None or reg.requests == 0:
                del self.host[name]
