"""LoRA adapters served beside the base model, many in one batch (docs/adapters.md).

    adapter.py   a PEFT directory read and checked (LoraError names the adapter and the field)
    targets.py   which linears of a native family an adapter may change, and where its modules land
    layer.py     LoraLinear (a base linear plus the step's deltas) and LoraBatch (the rows grouped by slot)
    manager.py   LoraManager: registered adapters, the host LRU, the device slots the scheduler seats into
"""
