"""``LinearWithLoRA`` with the Triton LoRA path (split-K shrink partials summed by the expand; work-item
list) equals the float32 reference, eagerly and replayed from a CUDA
graph, also when the graph itself groups the tokens by slot (as the engine's graphs do). GPU only.

(An overlapped variant, the delta on a side stream next to the base GEMM, measured slower
on an H200 and was removed: benchmarks/RESULTS.md.)"""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.models.llama import LinearWithLoRA, LoRABatch
from loraplex.kernels.lora_linear import add_lora_ref
from loraplex.kernels.lora_mapping import LoRAMapping, plan_segments
from loraplex.kernels.ops import Kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, WIDTHS, SLOTS, RANK = 512, [512, 128, 128], 6, 16


def _layer() -> LinearWithLoRA:
    dev, dt = torch.device("cuda"), torch.bfloat16
    layer = LinearWithLoRA(HIDDEN, WIDTHS, ["q_proj", "k_proj", "v_proj"], False, dt, dev, Kernels("triton"))
    layer.weight.normal_(0, HIDDEN**-0.5)
    a = [torch.randn(SLOTS, RANK, HIDDEN, device=dev).mul_(HIDDEN**-0.5).to(dt) for _ in WIDTHS]
    b = [torch.randn(SLOTS, w, RANK, device=dev).to(dt) for w in WIDTHS]
    layer.bind_lora(a, b, [torch.rand(SLOTS, device=dev) + 0.5 for _ in WIDTHS])
    return layer


def _expected(layer: LinearWithLoRA, x: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    y = torch.nn.functional.linear(x, layer.weight).float()
    add_lora_ref(x.float(), [a.float() for a in layer.lora_a], [b.float() for b in layer.lora_b],
                 layer.lora_scaling, y, mapping)
    return y


@pytest.mark.parametrize("num_tokens", [1, 32, 200])
def test_lora_linear_equals_reference_eager_and_in_graph(num_tokens):
    torch.manual_seed(num_tokens)
    layer = _layer()
    slots = torch.randint(-1, SLOTS, (num_tokens,), dtype=torch.int32, device="cuda")
    slots[0] = 2  # at least one LoRA token
    mapping = LoRAMapping.from_token_slots(slots)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    expected = _expected(layer, x, mapping)
    with torch.inference_mode():
        eager = layer(x, LoRABatch(mapping))
        torch.testing.assert_close(eager.float(), expected, atol=6e-2, rtol=3e-2)
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        layer(static_x, LoRABatch(mapping))  # warm-up outside capture (compile, tile list)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = layer(static_x, LoRABatch(mapping))
        x2 = torch.randn_like(x)
        static_x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), _expected(layer, x2, mapping), atol=6e-2, rtol=3e-2)


@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_grouping_built_inside_the_graph_follows_new_token_slots(num_tokens):
    """plan_segments captured with the layer: each replay regroups whatever token slots the buffer holds."""
    torch.manual_seed(num_tokens)
    layer = _layer()
    static_slots = torch.randint(-1, SLOTS, (num_tokens,), dtype=torch.int32, device="cuda")
    static_x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def forward():
        return layer(static_x, LoRABatch(plan_segments(static_slots, SLOTS, has_lora=True)))

    with torch.inference_mode():
        forward()  # warm-up outside capture (compile, pointer tables)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        for case in range(3):
            slots = torch.randint(-1, SLOTS, (num_tokens,), dtype=torch.int32)
            if case == 1:
                slots[:] = 4  # one adapter for every token
            slots[0] = 2  # at least one LoRA token
            static_slots.copy_(slots.cuda())
            static_x.copy_(torch.randn_like(static_x))
            graph.replay()
            torch.cuda.synchronize()
            expected = _expected(layer, static_x, LoRAMapping.from_token_slots(slots.cuda(), SLOTS))
            torch.testing.assert_close(out.float(), expected, atol=6e-2, rtol=3e-2)
