"""The Triton paged decode kernel (`triton_decode.paged_decode`) against the torch reference.

The kernel runs under Triton's interpreter on CPU tensors, so this needs no GPU: GQA
groups of 1, 2 and 7 (ajet-tiny's and Qwen2.5's shapes among them), head_dim 16 to 128,
page sizes 16 and 32, contexts on either side of page boundaries with a different
length in every row, pages in shuffled order, a trash page and the unread tail of each
last page full of 1e4 (reading either wrecks the result), one split, several, and more
splits than any row has pages; fp32, fp16 and (where the interpreter can) bf16.
FlexAttention (`decode_attention_flex`) is checked against the same reference.

Why a subprocess: Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function,
at import, and that includes its own library functions (`tl.zeros`, `tl.max`, ...),
decorated when `triton.language` is first imported. In a pytest-xdist worker another
file has usually imported it already (transformers does, running a model), and an
interpreted kernel that calls a compiled `tl.zeros` fails; setting the variable in this
process would also turn every kernel jitted later into an interpreted one. So one child
process, started with TRITON_INTERPRET=1, runs every kernel call (this file as a
script) and saves the outputs; the tests compare them here with the reference.

Triton itself is not on the suite's path (`tests/support/triton_env.py` says why and
where it is): only the child process has it. Where it cannot be found, the file skips
and says how to get it.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ajet.engine.generation.paged_attention import decode_attention_flex, decode_attention_torch
from tests.support.triton_env import interpreter_env, triton_missing

if (_MISSING := triton_missing()) is not None:
    pytest.skip(_MISSING, allow_module_level=True)

PROJECT_ROOT = Path(__file__).resolve().parents[3]
POISON = 1e4

#: (kv_heads, group, head_dim, page_size): ajet-tiny (H 4, KvH 2, D 16) and Qwen2.5-0.5B
#: (H 14, KvH 2, D 64) among them.
SHAPES = [(2, 1, 16, 16), (2, 2, 16, 16), (2, 7, 64, 16), (1, 2, 32, 32), (1, 7, 32, 32)]


def _lengths(page_size: int) -> tuple[int, ...]:
    return (1, page_size - 1, page_size, page_size + 1, 3 * page_size + 5)


@dataclass(frozen=True)
class Call:
    """One kernel call; `inputs()` builds the same tensors in any process (seeded)."""

    kv_heads: int
    group: int
    head_dim: int
    page_size: int
    lengths: tuple[int, ...]
    num_splits: int | None
    dtype: torch.dtype = torch.float32
    strided_q: bool = False
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """q, pools, block tables, lengths; every slot the kernel must not read poisoned."""
        gen = torch.Generator().manual_seed(self.seed)
        ps = self.page_size
        counts = [math.ceil(n / ps) for n in self.lengths]
        pages = sum(counts) + 3  # two pages nobody owns, then the trash page
        trash = pages - 1
        shape = (pages, ps, self.kv_heads, self.head_dim)
        k_pool, v_pool = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        k_pool[trash], v_pool[trash] = POISON, POISON
        # One trash entry past the longest row too, so every row's table ends in trash.
        tables = torch.full((len(self.lengths), max(counts) + 1), trash, dtype=torch.int32)
        order = torch.randperm(trash, generator=gen).to(torch.int32)  # scattered pages
        taken = 0
        for row, (length, count) in enumerate(zip(self.lengths, counts, strict=True)):
            if count == 0:
                continue  # an empty row (context 0): all trash
            tables[row, :count] = order[taken:taken + count]
            taken += count
            last = int(tables[row, count - 1])
            k_pool[last, length - (count - 1) * ps:] = POISON  # past the context
            v_pool[last, length - (count - 1) * ps:] = POISON
        heads = self.kv_heads * self.group
        q = torch.randn((heads, len(self.lengths), self.head_dim), generator=gen)
        # (B, H, D): the transposed view the attention layer hands over, or contiguous
        q = q.transpose(0, 1) if self.strided_q else q.transpose(0, 1).contiguous()
        lens = torch.tensor(self.lengths, dtype=torch.int32)
        return (q.to(self.dtype), k_pool.to(self.dtype), v_pool.to(self.dtype), tables, lens)


def _shape_id(shape: tuple[int, int, int, int]) -> str:
    return "kvh{}-g{}-d{}-ps{}".format(*shape)


#: 8 splits is more than any row's pages (5 block-table entries in these cases): checked on
#: one shape (each interpreted program costs CPU time: 0.2 to 0.7 s a call here). The
#: default (None) is one split for tables this short: checked once, for its code path.
CALLS: dict[str, Call] = {
    f"{_shape_id(shape)}-splits{splits}": Call(*shape, _lengths(shape[3]), splits)
    for shape in SHAPES for splits in (1, 3, 8)
    if splits != 8 or shape == SHAPES[0]
}
CALLS["default-splits"] = Call(*SHAPES[2], _lengths(16), None)
# No caller should send an empty row, but one must give zeros, not NaN.
CALLS["empty-row-splits1"] = Call(2, 2, 16, 16, (0, 20, 1), 1)
CALLS["empty-row-splits3"] = Call(2, 2, 16, 16, (0, 20, 1), 3)
# Qwen2.5-7B's heads (H 28, KvH 4, D 128), q strided as in the attention layer.
CALLS["qwen7b-strided"] = Call(4, 7, 128, 16, (17, 40), 2, strided_q=True)
for _dtype in (torch.float16, torch.bfloat16):
    for _splits in (1, 3):
        CALLS[f"{_dtype}-splits{_splits}"] = Call(2, 7, 64, 16, _lengths(16), _splits, _dtype)


def _bf16_dot_works() -> bool:
    """Whether this interpreter's tl.dot multiplies bf16 blocks right (in the child)."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(a_ptr: Any, out_ptr: Any) -> None:  # a @ a for one 16 x 16 block
        i = tl.arange(0, 16)
        a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
        tl.store(out_ptr + i[:, None] * 16 + i[None, :], tl.dot(a, a))

    a = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    product = torch.zeros(16, 16)
    probe[(1,)](a, product)
    return torch.allclose(product, a.float() @ a.float(), rtol=1e-2, atol=1e-2)


#: (head_dim, page_size, words of the refusal): shapes the kernel refuses before launching
REFUSED = [(80, 16, "head_dim"), (64, 8, "page size"), (64, 48, "page size")]
#: (batch, kv_heads, max_pages, page_size) for the default split count
SPLIT_CASES = [(1, 2, 512, 16), (256, 4, 512, 16), (1, 2, 4, 16), (1, 1, 100_000, 16)]


def _run_calls(results: Path) -> None:
    """The child: whether bf16 dots work here, every call's output (or its error, as
    text; bf16 calls only where they work), the refusals and the default splits."""
    from ajet.engine.generation import triton_decode
    from ajet.engine.generation.triton_decode import paged_decode

    bf16_works = _bf16_dot_works()
    outputs: dict[str, Any] = {"bf16-probe": bf16_works}
    for head_dim, page_size, _ in REFUSED:
        pool = torch.zeros(3, page_size, 2, head_dim)
        try:
            paged_decode(torch.zeros(1, 4, head_dim), pool, pool,
                         torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                         0.1)
            outputs[f"refused-{head_dim}-{page_size}"] = "accepted"
        except ValueError as exc:
            outputs[f"refused-{head_dim}-{page_size}"] = str(exc)
    outputs["splits"] = [triton_decode._default_splits(*case, torch.device("cpu"))
                         for case in SPLIT_CASES]
    outputs["max-splits"] = triton_decode._MAX_SPLITS
    for name, call in CALLS.items():
        if call.dtype == torch.bfloat16 and not bf16_works:
            continue
        q, k_pool, v_pool, tables, lens = call.inputs()
        try:
            outputs[name] = paged_decode(q, k_pool, v_pool, tables, lens, call.scale,
                                         num_splits=call.num_splits)
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others
            outputs[name] = f"{type(exc).__name__}: {exc}"
    torch.save(outputs, results)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    results = tmp_path_factory.mktemp("triton-decode") / "outputs.pt"
    child = subprocess.run([sys.executable, __file__, str(results)], check=False,
                           env=interpreter_env(),
                           capture_output=True, text=True, timeout=240, cwd=PROJECT_ROOT)
    assert child.returncode == 0, f"the interpreter run failed:\n{child.stderr[-4000:]}"
    loaded: dict[str, Any] = torch.load(results)
    return loaded


@pytest.mark.parametrize("name", list(CALLS))
def test_matches_the_reference(outputs: dict[str, Any], name: str) -> None:
    call = CALLS[name]
    if call.dtype == torch.bfloat16 and not outputs["bf16-probe"]:
        pytest.skip("this Triton's interpreter gets tl.dot wrong on bf16 (it multiplies the "
                    "uint16 storage), so a bf16 kernel cannot be checked on a CPU")
    out = outputs[name]
    assert isinstance(out, torch.Tensor), out
    q, k_pool, v_pool, tables, lens = call.inputs()
    assert out.shape == q.shape and out.dtype == call.dtype
    assert torch.isfinite(out).all()
    if call.dtype == torch.float32:
        ref = decode_attention_torch(q, k_pool, v_pool, tables, lens, call.scale)
        empty = lens == 0  # the reference's softmax over nothing is NaN
        ref[empty] = 0.0
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    # The same rounded inputs through the reference in fp32: only the kernel's rounding
    # (p cast to the pool's dtype for the second dot, the output) is left.
    ref = decode_attention_torch(q.float(), k_pool.float(), v_pool.float(), tables, lens,
                                 call.scale)
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[4]], ids=_shape_id)
def test_flex_matches_the_reference(shape: tuple[int, int, int, int]) -> None:
    call = Call(*shape, _lengths(shape[3]), None, seed=1)
    q, k_pool, v_pool, tables, lens = call.inputs()
    try:
        out = decode_attention_flex(q, k_pool, v_pool, tables, lens, call.scale)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"FlexAttention does not run eagerly on CPU with this torch: {exc}")
    ref = decode_attention_torch(q, k_pool, v_pool, tables, lens, call.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("head_dim", "page_size", "words"), REFUSED)
def test_refuses_shapes_it_cannot_tile(outputs: dict[str, Any], head_dim: int,
                                       page_size: int, words: str) -> None:
    """Checked before any launch, with the fix named."""
    assert re.search(f"{words}.*kernel \"torch\"", outputs[f"refused-{head_dim}-{page_size}"])


def test_default_splits_come_from_static_shapes(outputs: dict[str, Any]) -> None:
    """Small batches split long tables; a large batch or a short table does not split."""
    long_small, long_large, short, huge = outputs["splits"]
    assert long_small > 8 and long_large == 1
    assert short == 1  # 64 tokens: one split
    assert huge <= outputs["max-splits"]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run by test_triton_decode.py's fixture, with TRITON_INTERPRET=1")
    _run_calls(Path(sys.argv[1]))
