"""Which adapters sit in the device's ``max_loras`` slots, owned by the scheduler.

A running sequence with an adapter holds a reference to its slot from the step it is first
scheduled until it finishes or is preempted, so at most ``max_loras`` distinct adapters run in
any step. An adapter that is not resident takes a free slot, else the least recently used
slot no running sequence holds; the load (adapter id and path into that slot) travels with the
next StepPlan, and the runner copies the weights in before that step runs (stream-ordered:
a step already in flight reads the slot before the copy). When every slot is held, the
sequence waits and others go ahead.

    slots:  [ a7 (2 running) | a3 (idle) | - ]      acquire(a9): the free slot 2
                                                    acquire(a4): slot 1 (a3 evicted)
"""

from __future__ import annotations

from collections import OrderedDict

from tinyserve.messages import LoraLoad


class LoraSlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._holders: dict[int, int] = {}  # adapter id -> running sequences holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unheld: LRU first
        self._free = list(range(max_loras - 1, -1, -1))
        self._loads: list[LoraLoad] = []  # for the next plan
        # Adapters whose load into their slot failed: the slot is given up once no running
        # sequence holds it, and the adapter waits until then (its next load starts afresh)
        self._broken: set[int] = set()
        self.num_loads = 0  # adapters copied into a slot so far (swaps included)

    def acquire(self, adapter_id: int, path: str, scale: float) -> int | None:
        """The adapter's slot, held by one more sequence; None if every slot is held."""
        if adapter_id in self._broken:
            return None
        slot = self._slot_of.get(adapter_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._idle:
                evicted, _ = self._idle.popitem(last=False)
                slot = self._slot_of.pop(evicted)
            else:
                return None
            self._slot_of[adapter_id] = slot
            self._loads.append(LoraLoad(slot, adapter_id, path, scale))
            self.num_loads += 1
        self._idle.pop(adapter_id, None)
        self._holders[adapter_id] = self._holders.get(adapter_id, 0) + 1
        return slot

    def release(self, adapter_id: int) -> None:
        """One sequence less holds it; with none, it stays resident but may be evicted."""
        left = self._holders.get(adapter_id, 0) - 1
        if left > 0:
            self._holders[adapter_id] = left
            return
        self._holders.pop(adapter_id, None)
        if adapter_id in self._broken:
            self._broken.discard(adapter_id)
            self._free.append(self._slot_of.pop(adapter_id))
        elif adapter_id in self._slot_of:
            self._idle[adapter_id] = None

    def invalidate(self, adapter_id: int) -> None:
        """Its load failed (the runner emptied the slot): the slot is free once no sequence
        holds it, and the adapter is loaded anew by the next sequence after that."""
        if adapter_id not in self._slot_of:
            return
        if self._holders.get(adapter_id):
            self._broken.add(adapter_id)
            return
        self._idle.pop(adapter_id, None)
        self._free.append(self._slot_of.pop(adapter_id))

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter (no holder left): its slot is free again."""
        if self._holders.get(adapter_id):
            return
        self._idle.pop(adapter_id, None)
        slot = self._slot_of.pop(adapter_id, None)
        if slot is not None:
            self._free.append(slot)

    def take_loads(self) -> tuple[LoraLoad, ...]:
        loads, self._loads = tuple(self._loads), []
        return loads

    @property
    def resident(self) -> dict[int, int]:
        """adapter id -> slot."""
        return dict(self._slot_of)

    @property
    def held(self) -> set[int]:
        """The adapters running sequences hold."""
        return set(self._holders)

    def check_integrity(self) -> None:
        slots = list(self._slot_of.values()) + self._free
        assert sorted(slots) == list(range(self.max_loras)), slots
        assert set(self._idle) | set(self._holders) == set(self._slot_of), (
            self._idle, self._holders, self._slot_of)
        assert not set(self._idle) & set(self._holders)
        assert self._broken <= set(self._holders), (self._broken, self._holders)
