"""Skip connections sent straight from the cell that stashes them to the cell that pops them.

`layers.Stash` keeps a copy of the main activation in the activation dict under a
key, and a later `layers.Pop` combines it back. Carried inside the activation, a
skip that spans several cells would be copied into every cell in between, held
there as part of each recomputing cell's input, and its gradient passed back
through each of them. Like torchgpipe's portals, the executor instead takes the
stashed tensor out of the activation when it leaves the stashing cell, hands it
to the popping cell directly, and sends its gradient straight back.

Routes are found from the cells' top-level layers (a Stash or Pop nested inside
another layer is not seen and its skip simply rides along as before).
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from tfpipe.layers.composite import Pop, Stash
from tfpipe.pipeline.cell import Cell

Routes = dict[int, dict[str, int]]  # source cell -> {key: destination cell}


def routes(cells: Sequence[Cell]) -> Routes:
    """Every skip that crosses a cell boundary: source cell -> {key: destination cell}.

    A Pop pairs with the latest Stash of its key before it, as when the body runs
    in sequence; skips that start and end in one cell stay inside it.
    """
    stashed_in: dict[str, int] = {}
    out: Routes = {}
    for cell in cells:
        for layer in cell.layers:
            key = getattr(layer.params, 'key', None)
            if isinstance(layer, Pop) and key in stashed_in:
                source = stashed_in.pop(key)
                if source != cell.index:
                    out.setdefault(source, {})[key] = cell.index
            elif isinstance(layer, Stash):
                stashed_in[key] = cell.index
    return out


def inbound(route_table: Routes) -> dict[int, dict[str, int]]:
    """destination cell -> {key: source cell}."""
    out: dict[int, dict[str, int]] = {}
    for source, keys in route_table.items():
        for key, dest in keys.items():
            out.setdefault(dest, {})[key] = source
    return out


def take(activation: Any, keys: Iterable[str]) -> tuple[Any, dict[str, Any]]:
    """Splits `keys` off a dict activation: (the rest, {key: tensor}), keys sorted."""
    keys = sorted(k for k in keys if isinstance(activation, dict) and k in activation)
    if not keys:
        return activation, {}
    return ({k: v for k, v in activation.items() if k not in keys},
            {k: activation[k] for k in keys})


def give(activation: Any, received: dict[str, Any]) -> Any:
    """Adds the tensors a portal delivered back into the activation (inverse of take)."""
    if not received:
        return activation
    main = activation if isinstance(activation, dict) else {'x': activation}
    return {**main, **received}
