"""ModelRunner: one SchedulerOutput -> flat input tensors and per-group metadata -> model -> logits."""

from __future__ import annotations

import itertools

import torch

from hybridkv.kv.memory import KVCacheMemory
from hybridkv.kv.plan import KVPlan
from hybridkv.models.base import CausalLM
from hybridkv.request.batch import SchedulerOutput
from hybridkv.runner.attention import GroupMetadata, PagedAttention, Tile, Workspace
from hybridkv.runner.states import PagedStates, check_state_shapes
from hybridkv.runner.step_index import QUERY_TILE, IndexPack, StepIndex, run_kind


class ModelRunner:
    def __init__(self, model: CausalLM, plan: KVPlan, device: torch.device) -> None:
        self.model = model
        self.plan = plan
        self.device = device
        self.memory = KVCacheMemory(plan, device)
        self.workspace = Workspace()
        # Plans with recurrent state are exact: per-request tiles of the state's split unit (`step_index`).
        self.exact = plan.state is not None
        self.query_tile = plan.state.align if plan.state is not None else QUERY_TILE
        self.layer_group = {layer: plan.group_of(layer).group_id for layer in plan.attention_layers}
        if plan.state is not None:
            check_state_shapes(model.state_shapes(), plan.state)

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> tuple[list[str], torch.Tensor]:
        """Run every scheduled chunk; return the ids of requests to sample and their logits [M, vocab]."""
        # Decodes first, then short chunks, then long ones: each kind forms one run (see `step_index`).
        chunks = sorted(output.chunks, key=lambda c: run_kind(len(c.token_ids), self.query_tile, self.exact))
        pack = IndexPack()
        lengths = [len(c.token_ids) for c in chunks]
        step = StepIndex([c.start for c in chunks], lengths, pack, self.query_tile, self.exact)
        ids_slot, positions_slot = pack.add([t for c in chunks for t in c.token_ids]), pack.add(step.positions)
        ends = list(itertools.accumulate(step.lengths))
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        rows_slot = pack.add([ends[i] - 1 for i in sampled])
        masks: dict[tuple, list[Tile]] = {}
        metadata = [  # by group id; None for a state page group, which no attention layer reads
            GroupMetadata.build(
                step, [c.block_tables[g.group_id] for c in chunks], g.block_size, g.sliding_window, self.device, masks
            )
            if g.layers
            else None
            for g in self.plan.groups
        ]
        pack.upload(self.device)
        attn = PagedAttention(self.memory.views, self.layer_group, metadata, step, self.workspace)
        states = None
        if self.plan.state is not None:
            spans = list(itertools.pairwise([0, *ends]))
            states = PagedStates(self.plan.state, self.memory, chunks, self.plan.block_size, spans)
        hidden = self.model(pack[ids_slot], pack[positions_slot], attn, states)
        if states is not None:
            states.write_back()
        logits = self.model.compute_logits(hidden[pack[rows_slot]])
        return [chunks[i].request_id for i in sampled], logits
