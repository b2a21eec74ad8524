"""A router's arithmetic inside a transformers Mixtral (small config, random weights): with
"bf16-mixed,output=fp32" the router's logits are the bf16 operands' product in fp32, and fewer
tokens change their top-k experts at step 0 than with everything in bf16.

transformers 5 writes its router as a module with a `weight` and `F.linear`, not an nn.Linear;
here its projection is an nn.Linear (`LinearRouter`, as in benchmarks/moe_router.py), which is
what a plan's arithmetic reaches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precision_annot as pa

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402  (imported once, here)

bf16, fp32 = torch.bfloat16, torch.float32
#: 128 experts, top-8, hidden 64, one layer, 2,048 tokens: the size where fewer top-k sets
#: change with the router's fp32 output than with all bf16, against the fp64 model, by a
#: margin (seeds 0-3: 45-57 against 77-87 tokens); with 8 experts, top-2 and hidden 128 the
#: router's bf16 operands (its input and weight) move as many sets as its bf16 output does
TOKENS, HIDDEN, EXPERTS, TOP = 2048, 64, 128, 8


class LinearRouter(nn.Module):
    """Like transformers' `MixtralTopKRouter`, its projection an nn.Linear (`proj`)."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = router.top_k, router.hidden_dim
        self.proj = nn.Linear(router.hidden_dim, router.num_experts, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(router.weight)

    def forward(self, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits: torch.Tensor = self.proj(hidden_states.reshape(-1, self.hidden_dim))
        probs = F.softmax(logits.float(), dim=-1)
        top, indices = torch.topk(probs, self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), indices


def _mixtral(plan: dict[str, str] | None) -> nn.Module:
    """The same weights each call; `plan` applied over "bf16-mixed" (None: fp32, no plan)."""
    config = MixtralConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP, max_position_embeddings=64, attn_implementation="eager",
        experts_implementation="eager")
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    for layer in model.model.layers:
        layer.mlp.gate = LinearRouter(layer.mlp.gate)
    if plan is not None:
        pa.annotate(model, plan)
        pa.apply(model, default="bf16-mixed")
    return model


def _router_call(model: nn.Module, ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's input and logits (recorded by a forward hook on its Linear) and the top-k
    sets it hands the experts (sorted indices, by a hook on the router), on `ids`."""
    seen: list[tuple[torch.Tensor, ...]] = []
    layer = model.model.layers[0].mlp
    hooks = [layer.gate.proj.register_forward_hook(lambda m, a, out: seen.append((a[0], out))),
             layer.gate.register_forward_hook(lambda m, a, out: seen.append((out[2],)))]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    (x, logits), (indices,) = seen
    return x, logits, indices.sort(-1).values


def _changed(sets: torch.Tensor, logits: torch.Tensor) -> int:
    """The tokens whose top-k set differs from the top-k of `logits`."""
    ref = logits.double().topk(TOP, -1).indices.sort(-1).values
    return int((sets != ref).any(-1).sum())


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 64, (TOKENS // 64, 64), generator=torch.Generator().manual_seed(0))


def test_the_routers_fp32_output_is_its_bf16_operands_product_in_fp32(ids: torch.Tensor
                                                                       ) -> None:
    """The router's logits with "bf16-mixed,output=fp32" are its bf16 input and weight
    multiplied in fp32, by hand; all in bf16 they are rounded to bf16. No token's top-k set
    differs from the exact (fp64) product of its own operands; all bf16, some do."""
    wide = _mixtral({"*.gate.proj": "bf16-mixed,output=fp32"})
    x, logits, sets = _router_call(wide, ids)
    w = wide.model.layers[0].mlp.gate.proj.weight.detach()
    assert logits.dtype == fp32
    assert torch.equal(logits, x.to(bf16).float() @ w.to(bf16).float().t())
    assert _changed(sets, x.to(bf16).double() @ w.to(bf16).double().t()) == 0

    x, logits, sets = _router_call(_mixtral({}), ids)
    assert logits.dtype == bf16
    assert _changed(sets, x.to(bf16).double() @ w.to(bf16).double().t()) > 40  # measured 73


def test_fewer_top_k_sets_change_at_step_0_with_the_routers_fp32_output(ids: torch.Tensor
                                                                         ) -> None:
    """Against the same model in fp64, at step 0 (the same weights): all bf16 changes the
    top-8 set of 83 of 2,048 tokens, the router's fp32 output 45 (the bf16 operands' rounding
    and the bf16 layers before the router move the rest)."""
    exact = _mixtral(None).double()
    _, reference, _ = _router_call(exact, ids)
    _, _, low = _router_call(_mixtral({}), ids)
    _, _, wide = _router_call(_mixtral({"*.gate.proj": "bf16-mixed,output=fp32"}), ids)
    all_bf16, fp32_output = _changed(low, reference), _changed(wide, reference)
    assert all_bf16 > 40
    assert fp32_output < 0.75 * all_bf16, (fp32_output, all_bf16)
