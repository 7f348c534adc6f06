"""User-given prompt embeddings on Model Runner V2, without a table of device pointers.

Upstream's ``PromptEmbedsState`` (``v1/worker/gpu/model_states/prompt_embeds.py``) keeps
each request's embeddings in a tensor of its own and copies them into the step's input
embeddings with one Triton kernel that reads a table of their device addresses; a torch
op cannot follow an address. This state keeps the live requests' embeddings in one
device tensor instead (re-joined when requests are added, off the per-step path) and
finds each scheduled row by index, with device ops only: no Python loop over requests
and no read back to the host. Same interface; the Ascend V2 runner installs it in place
of upstream's (``worker/model_runner.py``).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import request_of_token


class NPUPromptEmbedsState:
    def __init__(self, max_num_reqs: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        # req_id -> (request slot, embeddings, is-token-id mask or None), on the device
        self.requests: dict[str, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        self._stale = False
        # per request slot: first row in ``rows`` and number of rows (0: no embeddings)
        self.start = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.length = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self.rows = torch.zeros(1, hidden_size, dtype=dtype, device=device)
        self.is_token_id = torch.zeros(1, dtype=torch.bool, device=device)

    def add_request(self, req_index: int, new_req_data) -> None:
        # (a reused slot drops whatever it held; upstream applies the staged writes next)
        req_id = new_req_data.req_id
        self.requests = {k: v for k, v in self.requests.items() if k != req_id and v[0] != req_index}
        self._stale = True
        embeds = new_req_data.prompt_embeds
        if embeds is None:
            return
        rows = embeds.to(device=self.device, dtype=self.dtype, non_blocking=True)
        # a prompt that mixes token ids and embeddings marks its token ids: list[bool]
        # in the scheduler's NewRequestData
        mask = new_req_data.prompt_is_token_ids
        if mask is None:
            mask = torch.zeros(rows.shape[0], dtype=torch.bool, device=self.device)
        else:
            mask = torch.as_tensor(mask, dtype=torch.bool).to(self.device, non_blocking=True)
        self.requests[req_id] = (req_index, rows.reshape(-1, self.hidden_size), mask)

    def remove_request(self, req_id: str) -> None:
        # its rows stay in ``rows`` until the next request is added: its slot is not scheduled
        self.requests.pop(req_id, None)

    def apply_staged_writes(self) -> None:
        if not self._stale:
            return
        self._stale = False
        self.length.zero_()
        if not self.requests:
            return
        slots, rows, masks = zip(*self.requests.values())
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
        index = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        self.start[index] = (lengths.cumsum(0) - lengths).to(self.device, non_blocking=True)
        self.length[index] = lengths.to(self.device, non_blocking=True)
        self.rows = torch.cat(rows)
        self.is_token_id = torch.cat(masks)

    def apply(self, input_batch, num_computed_tokens: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
        """Overwrite the rows of ``inputs_embeds`` that a request's given embeddings
        cover (not the rows its mask marks as token ids, nor rows past its embeddings)."""
        if not self.requests:
            return
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        ends = input_batch.query_start_loc[1 : num_reqs + 1]
        token_req, offset, inside = request_of_token(ends, num_tokens)
        req = input_batch.idx_mapping[:num_reqs].to(torch.int64)[token_req]
        source = num_computed_tokens[req].to(torch.int64) + offset
        given = inside & (source < self.length[req])
        row = (self.start[req] + source).clamp(0, self.rows.shape[0] - 1)
        given &= ~self.is_token_id[row]
        target = inputs_embeds[:num_tokens]
        target.copy_(torch.where(given[:, None], self.rows[row], target))
