"""ModelRunner: one SchedulerOutput -> flat input tensors and per-group metadata -> model -> logits."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan
from hybridkv.models.base import CausalLM, OutputRows
from hybridkv.request.batch import ScheduledChunk, SchedulerOutput
from hybridkv.runner import kernels
from hybridkv.runner.attention import GroupMetadata, PagedAttention, Workspace
from hybridkv.runner.attention_masks import Tile
from hybridkv.runner.heap import HeapPolicy
from hybridkv.runner.states import PagedStates, check_state_shapes, steps_in_place
from hybridkv.runner.step_index import QUERY_TILE, IndexPack, StepIndex, run_kind


class ChunkLogits(NamedTuple):
    """The logits of every token of one chunk: row j is position start + j's (it predicts token start + j + 1)."""

    request_id: str
    start: int
    logits: torch.Tensor


class ModelRunner:
    def __init__(self, model: CausalLM, plan: KVPlan, device: torch.device, exact_tile: int | None = None) -> None:
        """`exact_tile`: run exact steps (the same bits in every mode) with query tiles of this size, a multiple
        of the block size at which the scheduler splits prompts; plans with recurrent state always do, with
        their state's split unit."""
        self.model = model
        self.plan = plan
        self.device = device
        self.memory = KVCacheMemory(plan, device)
        self.workspace = Workspace()
        self.out_workspace = Workspace()  # the output rows' attention (`OutputRows`) gathers into its own buffers
        self.heap = HeapPolicy.for_device(device.type)
        # Exact steps: per-request tiles of the split unit (`step_index`).
        if plan.state is not None:
            exact_tile = plan.state.align
        self.exact = exact_tile is not None
        self.query_tile = exact_tile or QUERY_TILE
        self.layer_group = {layer: plan.group_of(layer).group_id for layer in plan.attention_layers}
        self.state_kernel: object | None = None  # steps one-token chunks' states in the pool (`states`)
        # Bundle head -> its pages, row by row as `SchedulerOutput.new_bundles` reports them: [num_blocks, m].
        self.bundle_pages = torch.zeros(plan.num_blocks, plan.state.num_pages if plan.state else 0, dtype=torch.long)
        if plan.state is not None:
            check_state_shapes(model.state_shapes(), plan.state)
            if device.type == "cpu" and model.steps_states_in_place and steps_in_place(plan.state):
                self.state_kernel = kernels.state_step()
        # Decodes read K/V in place when the native kernel is built and the cache holds the model's dtype.
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} | {
            v.dtype for v in self.memory.views.values()
        }
        self.decode_kernel = kernels.paged_decode() if device.type == "cpu" and len(dtypes) == 1 else None
        self.write_kernel = kernels.cache_write() if device.type == "cpu" else None
        # Prefill runs too, in bfloat16 with head sizes the kernel's vectors divide (and not in exact steps).
        bf16 = self.decode_kernel is not None and dtypes == {torch.bfloat16}
        heads_fit = all(v.shape[-1] % 32 == 0 for v in self.memory.views.values())
        self.prefill_kernel = kernels.paged_prefill() if bf16 and heads_fit else None

    def _metadata(self, step: StepIndex, tables: list[list[list[int]]]) -> list[GroupMetadata | None]:
        """Per group id; None for the state group, which no attention layer reads. `tables[r][g]`: request
        r's block table in group g."""
        masks: dict[tuple, list[Tile]] = {}  # shared by this step's groups with the same window and spans
        return [
            GroupMetadata.build(
                step,
                [t[g.group_id] for t in tables],
                g.block_size,
                g.sliding_window,
                self.device,
                masks,
                in_place_decode=self.decode_kernel is not None,
                causal_split=self.device.type == "cpu",
                in_place_prefill=self.prefill_kernel is not None,
            )
            if g.layers
            else None
            for g in self.plan.groups
        ]

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> tuple[list[str], torch.Tensor, list[ChunkLogits]]:
        """Run every scheduled chunk; return the ids of requests to sample, their logits [M, vocab], and the
        logits of every token of the chunks that asked for them (`ScheduledChunk.all_logits`)."""

        # Decodes first, then short chunks, then long ones: each kind forms one run (see `step_index`).
        # With the prefill kernel, a one-token prompt chunk attends as a prefill (the same bits as unchunked).
        def decode(c: ScheduledChunk) -> bool:
            return self.prefill_kernel is None or not c.prompt

        def kind(c: ScheduledChunk) -> int:
            return run_kind(len(c.token_ids), self.query_tile, self.exact, decode(c))

        if output.new_bundles:
            heads = torch.tensor(list(output.new_bundles), dtype=torch.long)
            self.bundle_pages[heads] = torch.tensor(list(output.new_bundles.values()), dtype=torch.long)
        chunks = sorted(output.chunks, key=kind)
        pack = IndexPack()
        lengths = [len(c.token_ids) for c in chunks]
        self.heap.before_step(sum(lengths))
        decodes = [decode(c) for c in chunks]
        solo = self.exact and self.decode_kernel is None
        step = StepIndex([c.start for c in chunks], lengths, pack, self.query_tile, self.exact, decodes, solo)
        ids_slot, positions_slot = pack.add([t for c in chunks for t in c.token_ids]), pack.add(step.positions)
        ends = list(itertools.accumulate(step.lengths))
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        # Output rows: each sampled chunk's last token, then every token of the chunks that want all logits.
        every = [i for i, c in enumerate(chunks) if c.all_logits]
        out_chunks = sampled + [i for i in every for _ in range(lengths[i])]
        out_rows = [ends[i] - 1 for i in sampled] + [r for i in every for r in range(ends[i] - lengths[i], ends[i])]
        rows_slot = pack.add(out_rows)
        metadata = self._metadata(step, [c.block_tables for c in chunks])
        narrow = self.model.narrows_outputs
        # A step of decodes alone is its own output step; otherwise the output rows alone, one query each
        # at its position (`OutputRows`).
        same = len(sampled) == len(chunks) and all(n == 1 for n in lengths) and not every
        if narrow and not same:
            out_positions = [step.positions[r] for r in out_rows]
            out_step = StepIndex(out_positions, [1] * len(out_rows), pack, self.query_tile, self.exact, solo=solo)
            out_metadata = self._metadata(out_step, [chunks[i].block_tables for i in out_chunks])
        pack.upload(self.device)
        kernels_ = {
            "decode_kernel": self.decode_kernel,
            "prefill_kernel": self.prefill_kernel,
            "write_kernel": self.write_kernel,
        }
        attn = PagedAttention(self.memory.views, self.layer_group, metadata, step, self.workspace, **kernels_)
        states = None
        if self.plan.state is not None:
            spans = list(itertools.pairwise([0, *ends]))
            states = PagedStates(self.plan.state, self.memory, self.bundle_pages, chunks, spans, self.state_kernel)
        ids, positions, rows = pack[ids_slot], pack[positions_slot], pack[rows_slot]
        if narrow:
            out_attn = attn
            if not same:
                views, ws = self.memory.views, self.out_workspace
                out_attn = PagedAttention(views, self.layer_group, out_metadata, out_step, ws, **kernels_)
            hidden = self.model(ids, positions, attn, states, OutputRows(rows, out_attn))
        else:
            hidden = self.model(ids, positions, attn, states)[rows]
        if states is not None:
            states.write_back()
        logits = self.model.compute_logits(hidden)
        extra, at = [], len(sampled)
        for i in every:
            extra.append(ChunkLogits(chunks[i].request_id, chunks[i].start, logits[at : at + lengths[i]]))
            at += lengths[i]
        return [chunks[i].request_id for i in sampled], logits[: len(sampled)], extra
