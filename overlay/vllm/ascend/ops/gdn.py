"""The Ascend form of upstream's Qwen Gated DeltaNet layer (Qwen3-Next, Qwen3.5).

Registered with ``PluggableLayer.register_oot`` in place of
``QwenGatedDeltaNetAttention``: upstream's layer sends an out-of-tree platform down its
CUDA path, where the convolution, the gating and the recurrence are Triton kernels (its
CPU path calls compiled CPU ops this wheel does not build). This form keeps upstream's
parameters, weight loading, projections, gated norm and output projection, and runs the
core from ``vllm.ascend.kernels.gdn`` sequence by sequence over the layer's state cache:
the conv state ``[slots, W-1, D]`` (upstream's default layout; the transposed one when
``VLLM_SSM_CONV_STATE_LAYOUT=DS``) and the recurrent state ``[slots, HV, Dv, Dk]``, one
slot per request (upstream's GDN metadata names it). A prefill chunk starts from the
request's state when it has computed tokens and writes it back; the chunked form runs
prefills, the recurrent one decodes.

With the NPU kernels the whole batch runs without reading a length back to the host: the
convolution for every sequence at once (``gdn.conv_batch``), the decodes through torch_npu's
recurrent op (inside a decode graph through ``gdn.recurrent_step_batch`` instead: the op is
documented for single-op and static-graph modes only), the prefills through its chunked op.
With drafts (MTP) every decode is a verification row of 1 + k tokens: each position's
recurrent state is kept in its own state slot and the conv buffer holds k more inputs, so the
next step starts from the last accepted token's (upstream's layout); with the NPU kernels the
rows go through the recurrent op with its ``num_accepted_tokens`` (``gdn.npu_verify``; in a
decode graph ``gdn.recurrent_verify_batch``). Prefix caching, KV connectors and context
parallelism with these layers are refused at start-up (``platform/model_features.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange

from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import PluggableLayer
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm.ascend import device as ascend_device
from vllm.ascend.kernels import gdn, npu_kernels


class AscendQwenGatedDeltaNet(QwenGatedDeltaNetAttention):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_method = self.forward_ascend
        # upstream's fused decode and speculative paths are Triton kernels
        self.enable_packed_recurrent_decode = False
        self.enable_fused_gdn_spec_decode = False

    def forward_ascend(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        if self.gqa_interleaved_layout:  # Qwen3-Next: q, k, v, z, b, a interleaved per key head
            query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
            query, key, value = (rearrange(t, "l p d -> l (p d)") for t in (query, key, value))
            mixed_qkv = torch.cat((query, key, value), dim=-1)
        else:  # Qwen3.5: [q, k, v | z] and [b | a]
            qkv_size = (self.key_dim * 2 + self.value_dim) // self.tp_size
            mixed_qkv, z = mixed_qkvz.split([qkv_size, self.value_dim // self.tp_size], dim=-1)
            z = z.reshape(z.size(0), -1, self.head_v_dim)
            b, a = ba.chunk(2, dim=-1)
        core = torch.zeros(
            hidden_states.shape[0],
            self.num_v_heads // self.tp_size,
            self.head_v_dim,
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict) and metadata.get(self.prefix) is not None:
            self._run_core(mixed_qkv, b, a, core, metadata[self.prefix])
        # (no metadata: a profile or dummy run; the state cache is not touched)
        return self._output_projection(core, z)

    def _state_and_weight(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv state as [slots, W-1, D] (either upstream layout), the recurrent state
        [slots, HV, Dv, Dk], and the conv weight [D, W]."""
        conv_state, ssm_state = self.kv_cache[0], self.kv_cache[1]
        if is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        return conv_state, ssm_state, self.conv1d.weight.view(self.conv1d.weight.size(0), -1)

    def _split_heads(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output ``[T, q | k | v]`` as this rank's key, key and value heads."""
        key, value = self.key_dim // self.tp_size, self.value_dim // self.tp_size
        q, k, v = y.split([key, key, value], dim=-1)
        heads_k, heads_v = self.num_k_heads // self.tp_size, self.num_v_heads // self.tp_size
        return q.unflatten(-1, (heads_k, -1)), k.unflatten(-1, (heads_k, -1)), v.unflatten(-1, (heads_v, -1))

    def _run_core(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        metadata: GDNAttentionMetadata,
    ) -> None:
        on_npu = npu_kernels()
        run_sequences = self._run_sequences_npu if on_npu else self._run_sequences
        if metadata.spec_sequence_masks is None:
            run_sequences(mixed_qkv, b, a, out, metadata)
            return
        # with drafts every decode is a verification row (upstream's V2 runner); the
        # other sequences are prefills, their tokens elsewhere in the batch
        verify = self._run_verification_npu if on_npu else self._run_verification
        tokens = metadata.num_spec_decode_tokens
        plain = metadata.num_decodes + metadata.num_prefills
        if not plain:  # the verification rows lead the batch (a graph's padding trails)
            verify(mixed_qkv, b, a, out, metadata)
            return
        rows = metadata.spec_token_indx[:tokens]
        spec_out = out[rows].clone()
        verify(mixed_qkv[rows], b[rows], a[rows], spec_out, metadata)
        out[rows] = spec_out
        rows = metadata.non_spec_token_indx[: metadata.num_actual_tokens - tokens]
        plain_out = out[rows].clone()
        run_sequences(mixed_qkv[rows], b[rows], a[rows], plain_out, metadata)
        out[rows] = plain_out

    def _run_verification(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        metadata: GDNAttentionMetadata,
    ) -> None:
        """Each request's 1 + k tokens (the last sampled one, then its drafts) from the state
        after the tokens the previous step accepted. Upstream's layout: a request's conv
        buffer holds W - 1 + k inputs, its window starts ``accepted - 1`` in, and after the
        step it holds the window's last W - 2 inputs and this step's; its recurrent state
        after token t goes to its t-th state slot, the next step starting from slot
        ``accepted - 1``."""
        conv_state, ssm_state, weight = self._state_and_weight()
        width = weight.shape[1]
        requests = metadata.num_spec_decodes
        assert metadata.spec_query_start_loc is not None
        assert metadata.spec_state_indices_tensor is not None and metadata.num_accepted_tokens is not None
        bounds = metadata.spec_query_start_loc[: requests + 1].tolist()
        slots = metadata.spec_state_indices_tensor[:requests].tolist()
        accepted = metadata.num_accepted_tokens[:requests].tolist()
        for i in range(requests):
            lo, hi, row, shift = bounds[i], bounds[i + 1], slots[i], accepted[i] - 1
            if hi == lo:
                continue
            buffer = conv_state[row[0]]
            window = buffer[shift : shift + width - 1]
            y, _ = gdn.conv(mixed_qkv[lo:hi], weight, window)
            rolled = torch.cat([window.to(y.dtype), mixed_qkv[lo:hi]])[1:]
            buffer[: rolled.shape[0]] = rolled
            q, k, v = self._split_heads(y)
            g, beta = gdn.gating(a[lo:hi], b[lo:hi], self.A_log, self.dt_bias)
            state = ssm_state[row[shift]]
            for t in range(hi - lo):  # one state per position: any of them may be the last accepted
                o, new = gdn.recurrent_delta_rule(
                    q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state
                )
                ssm_state[row[t]] = new.to(ssm_state.dtype)
                state = ssm_state[row[t]]
                out[lo + t] = o[0].to(out.dtype)

    def _run_sequences(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        metadata: GDNAttentionMetadata,
    ) -> None:
        """Prefill chunks and decodes without drafts, each from its sequence's state."""
        conv_state, ssm_state, weight = self._state_and_weight()
        history = weight.shape[1] - 1  # with drafts the conv buffer is longer: its first W - 1
        sequences = metadata.num_decodes + metadata.num_prefills
        assert metadata.non_spec_query_start_loc is not None
        assert metadata.non_spec_state_indices_tensor is not None
        bounds = metadata.non_spec_query_start_loc[: sequences + 1].tolist()
        slots = metadata.non_spec_state_indices_tensor[:sequences].tolist()
        started = (
            metadata.has_initial_state.tolist()
            if metadata.has_initial_state is not None
            else [True] * sequences
        )
        for i in range(sequences):
            lo, hi, slot = bounds[i], bounds[i + 1], slots[i]
            if hi == lo:
                continue
            y, conv_state[slot, :history] = gdn.conv(
                mixed_qkv[lo:hi], weight, conv_state[slot, :history] if started[i] else None
            )
            q, k, v = self._split_heads(y)
            g, beta = gdn.gating(a[lo:hi], b[lo:hi], self.A_log, self.dt_bias)
            rule = gdn.recurrent_delta_rule if i < metadata.num_decodes else gdn.chunked_delta_rule
            o, state = rule(q, k, v, g, beta, ssm_state[slot] if started[i] else None)
            ssm_state[slot] = state.to(ssm_state.dtype)
            out[lo:hi] = o.to(out.dtype)

    def _run_verification_npu(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        metadata: GDNAttentionMetadata,
    ) -> None:
        """``_run_verification`` for the whole batch at once: the convolution in torch over
        each buffer's window, the recurrence through torch_npu's op with
        ``num_accepted_tokens`` (in a decode graph: its torch form over the graph's padded
        batch, whose padding names the null block)."""
        conv_state, ssm_state, weight = self._state_and_weight()
        slots, starts = metadata.spec_state_indices_tensor, metadata.spec_query_start_loc
        accepted = metadata.num_accepted_tokens
        assert slots is not None and starts is not None and accepted is not None
        capturing = ascend_device.current().is_capturing()
        if not capturing:  # eager: the op wants every sequence non-empty, no padding rows
            requests, tokens = metadata.num_spec_decodes, metadata.num_spec_decode_tokens
            slots, starts, accepted = slots[:requests], starts[: requests + 1], accepted[:requests]
            mixed_qkv, b, a = mixed_qkv[:tokens], b[:tokens], a[:tokens]
        y = gdn.conv_verify_batch(mixed_qkv, weight, conv_state, starts, slots[:, 0], accepted)
        q, k, v = self._split_heads(y)
        q, k = gdn.normalise_qk(q, k)
        g, beta = gdn.gating(a, b, self.A_log, self.dt_bias)
        form = (
            gdn.npu_verify if self._recurrent_op_takes(ssm_state, q.shape[0]) else gdn.recurrent_verify_batch
        )
        o = form(q, k, v, g, beta, ssm_state, slots, starts, accepted)
        out[: o.shape[0]] = o.to(out.dtype)

    @staticmethod
    def _recurrent_op_takes(ssm_state: torch.Tensor, tokens: int) -> bool:
        """Whether torch_npu's recurrent op may run here: not inside a decode graph (its page
        documents single-op and static-graph modes only) and not over a state cache of fewer
        rows than tokens (its page wants BlockNum >= T; upstream's graph-memory profile
        builds a cache of a few blocks). Otherwise its torch form runs."""
        return not ascend_device.current().is_capturing() and ssm_state.shape[0] >= tokens

    def _run_sequences_npu(
        self,
        mixed_qkv: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        out: torch.Tensor,
        metadata: GDNAttentionMetadata,
    ) -> None:
        """``_run_sequences`` for the whole batch at once (decodes, then prefills)."""
        conv_state, ssm_state, weight = self._state_and_weight()
        conv_state = conv_state[:, : weight.shape[1] - 1]  # with drafts the buffer is longer
        assert metadata.non_spec_query_start_loc is not None
        assert metadata.non_spec_state_indices_tensor is not None
        decodes, sequences = metadata.num_decodes, metadata.num_decodes + metadata.num_prefills
        starts = metadata.non_spec_query_start_loc[: sequences + 1]
        slots = metadata.non_spec_state_indices_tensor[:sequences]
        y = gdn.conv_batch(mixed_qkv, weight, conv_state, starts, slots, metadata.has_initial_state)
        q, k, v = self._split_heads(y)
        q, k = gdn.normalise_qk(q, k)
        g, beta = gdn.gating(a, b, self.A_log, self.dt_bias)
        decode_tokens = metadata.num_decode_tokens  # one per decode: no drafts here
        if decodes:
            part = slice(0, decode_tokens)
            form = (
                gdn.npu_decode
                if self._recurrent_op_takes(ssm_state, decode_tokens)
                else gdn.recurrent_step_batch
            )
            o = form(q[part], k[part], v[part], g[part], beta[part], ssm_state, slots[:decodes])
            out[part] = o.to(out.dtype)
        if metadata.num_prefills:
            part = slice(decode_tokens, decode_tokens + metadata.num_prefill_tokens)
            initial = metadata.has_initial_state
            o = gdn.npu_prefill(
                q[part],
                k[part],
                v[part],
                g[part],
                beta[part],
                ssm_state,
                slots[decodes:],
                starts[decodes:] - starts[decodes],
                None if initial is None else initial[decodes:sequences],
            )
            out[part] = o.to(out.dtype)


def register() -> None:
    PluggableLayer.register_oot(AscendQwenGatedDeltaNet, name="QwenGatedDeltaNetAttention")
