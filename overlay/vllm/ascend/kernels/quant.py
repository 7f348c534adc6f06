"""W8A8 kernels (msModelSlim checkpoints): activation quantization and int8 matmuls.

Integer semantics, shared by both forms:

* static activations: ``x_q = clamp(round(x / input_scale + input_offset), -128, 127)``,
  round half to even (per-tensor scale and offset);
* dynamic activations: per row ``scale = max|x| / 127``, ``x_q = round(x / scale)``;
* int8 x int8 products accumulated in int32;
* static output ``(acc + quant_bias) * deq_scale`` (``deq_scale`` per output channel:
  input scale x weight scale; ``quant_bias`` folds the float bias and the input offset);
* dynamic output ``acc * weight_scale * token_scale + bias``.

Weights are held transposed, ``[k, n]`` int8, the layout ``npu_quant_matmul`` takes.
The reference forms compute exactly this in plain torch (int32 matmul on the CPU); the
NPU forms call torch_npu's ``npu_quantize``, ``npu_dynamic_quant`` and
``npu_quant_matmul`` (they pass the contract double; not verified on an NPU).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu

INT8_MIN, INT8_MAX = -128, 127


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# -- activation quantization ------------------------------------------------------------
# A static layer's activation parameters are put once, after loading, into the form its
# ``quantize_static`` takes (``static_params``); the two forms take different ones.
def reference_static_params(
    input_scale: torch.Tensor, input_offset: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-tensor scale and offset as float32 tensors of one element."""
    return input_scale.to(torch.float32).reshape(1), input_offset.to(torch.float32).reshape(1)


def reference_quantize_static(
    x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor
) -> torch.Tensor:
    """Per-tensor asymmetric int8 (``input_scale``/``input_offset`` float tensors of one element)."""
    q = torch.round(x.to(torch.float32) / input_scale.to(torch.float32) + input_offset.to(torch.float32))
    return q.clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def npu_static_params(
    input_scale: torch.Tensor, input_offset: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_quantize`` multiplies: the scale's reciprocal and the zero point as float32
    vectors along the input's last axis (width ``k``), as vllm-ascend prepares them."""
    reciprocal = (1.0 / input_scale.to(torch.float32)).reshape(1).expand(k).contiguous()
    return reciprocal, input_offset.to(torch.float32).reshape(1).expand(k).contiguous()


def npu_quantize_static(
    x: torch.Tensor, scale_reciprocal: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """``npu_quantize`` in multiply mode (``x * (1 / scale) + zero_point``, rounded half to
    even, saturated) with ``npu_static_params``' vectors. Multiplying by the reciprocal may
    round an exact .5 tie differently from the reference's division. The activations go in
    their own dtype (the op takes float16/bfloat16 input with float32 scales; a float32 copy
    would be one more launch and twice the bytes); the reciprocal and zero point stay
    float32, since in bfloat16 they would move the quantization grid."""
    return torch_npu().npu_quantize(x, scale_reciprocal, offset, torch.qint8, axis=-1, div_mode=False)


def reference_quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 and the row scales (float32, ``x.shape[:-1]``)."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row quantizes to zeros
    q = torch.round(xf / safe.unsqueeze(-1)).clamp(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, scale


def npu_quantize_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_dynamic_quant`` (int8 output, per-token mode)."""
    return torch_npu().npu_dynamic_quant(x)


# -- int8 matmuls -----------------------------------------------------------------------
def _int32_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    return torch.mm(_rows(x_q).to(torch.int32), w_q.to(torch.int32))


def reference_matmul_static(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x_q [..., k]`` int8, ``w_q [k, n]`` int8, ``deq_scale [n]`` float32,
    ``quant_bias [n]`` int32 or None (TP ranks other than the first of a row-parallel
    layer add none: the partial sums are all-reduced)."""
    acc = _int32_matmul(x_q, w_q)
    if quant_bias is not None:
        acc = acc + quant_bias.to(torch.int32)
    out = acc.to(torch.float32) * deq_scale.to(torch.float32)
    return out.to(out_dtype).reshape(*x_q.shape[:-1], w_q.shape[1])


def npu_matmul_static(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    deq_scale: torch.Tensor,
    quant_bias: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch_npu().npu_quant_matmul(
        _rows(x_q), w_q, deq_scale.to(torch.float32), bias=quant_bias, output_dtype=out_dtype
    )
    return out.reshape(*x_q.shape[:-1], w_q.shape[1])


def reference_matmul_dynamic(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    weight_scale: torch.Tensor,
    token_scale: torch.Tensor,
    bias: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``weight_scale [n]`` and ``token_scale [...]`` float32; ``bias [n]`` float or None."""
    acc = _int32_matmul(x_q, w_q).to(torch.float32)
    out = acc * weight_scale.to(torch.float32) * token_scale.reshape(-1, 1).to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype).reshape(*x_q.shape[:-1], w_q.shape[1])


def npu_matmul_dynamic(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    weight_scale: torch.Tensor,
    token_scale: torch.Tensor,
    bias: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch_npu().npu_quant_matmul(
        _rows(x_q),
        w_q,
        weight_scale.to(torch.float32),
        pertoken_scale=token_scale.reshape(-1).to(torch.float32),
        bias=bias,
        output_dtype=out_dtype,
    )
    return out.reshape(*x_q.shape[:-1], w_q.shape[1])


static_params = pick(reference_static_params, npu_static_params)
quantize_static = pick(reference_quantize_static, npu_quantize_static)
quantize_dynamic = pick(reference_quantize_dynamic, npu_quantize_dynamic)
matmul_static = pick(reference_matmul_static, npu_matmul_static)
matmul_dynamic = pick(reference_matmul_dynamic, npu_matmul_dynamic)
