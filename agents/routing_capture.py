"""`RoutingCapture`: the top-k experts a MoE model's routers chose in its last forward (routing replay, R3).

Forward hooks on each MoE layer's router (`layer.mlp.gate`, Hugging Face Qwen3-MoE / Qwen2-MoE / Mixtral style:
it returns `(router_logits, top_k_weights, top_k_index)` over the flattened `[batch * seq]` tokens) keep that
forward's `top_k_index` per layer. The engine then asks for the rows of the positions it sampled from
(`rows(flat_positions)`): `[n, num_hidden_layers, top_k]` int16, dense layers 0 as in SGLang's capture buffer.
Nothing is copied for forwards nobody asks about beyond a reference to the router's own output.
"""

from __future__ import annotations

from typing import Any

import torch


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """`(layer index, router module)` of every MoE layer of a transformers causal LM (empty for a dense model)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    out = []
    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight") and \
                getattr(gate, "num_experts", None) is not None:
            out.append((i, gate))
    return out


class RoutingCapture:
    """Keeps the last forward's routing of `model` (see the module docstring); `close()` removes the hooks."""

    def __init__(self, model: Any):
        routers = moe_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router (layer.mlp.gate with top_k): "
                             "nothing to capture")
        self.num_layers = len(model.model.layers)
        self.top_k = int(routers[0][1].top_k)
        self.num_experts = int(routers[0][1].num_experts)
        self._last: dict[int, torch.Tensor] = {}
        self._hooks = [gate.register_forward_hook(self._hook(i)) for i, gate in routers]

    def _hook(self, layer: int):
        def hook(module: Any, args: Any, output: Any) -> None:
            self._last[layer] = output[2] if isinstance(output, tuple) else output
        return hook

    def rows(self, flat_positions: torch.Tensor | list[int]) -> torch.Tensor:
        """`[len(flat_positions), num_layers, top_k]` int16 on the CPU: the routing of those flattened positions of
        the last forward (`batch_index * seq_len + column`)."""
        index = torch.as_tensor(flat_positions, dtype=torch.long)
        out = torch.zeros((len(index), self.num_layers, self.top_k), dtype=torch.int16)
        for layer, top in self._last.items():
            out[:, layer] = top.reshape(-1, self.top_k)[index.to(top.device)].to("cpu", torch.int16)
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
