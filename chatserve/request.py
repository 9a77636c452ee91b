"""Request: one generation's token ids, progress counters and block table. No tensors.

Regions of `token_ids` (prompt + generated, all committed, never drafts):

    [0, num_computed_tokens)              KV in the target cache
    [num_computed_tokens, len(token_ids)) still to feed to the target (prefill or last token)
    [0, num_draft_computed_tokens)        KV in the draft model's cache: the prefix-cache blocks that
                                          carry the draft-KV mark, then what the draft has seen
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from chatserve.block_manager import BlockTable
from chatserve.sampling_params import RequestStats, SamplingParams

if TYPE_CHECKING:
    from chatserve.grammar import GrammarMatcher
    from chatserve.spec_methods import SpecState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    spec: SpecState | None = None  # its speculation (SpecRunner); None = never drafts
    num_lookahead_tokens: int = 0  # drafts planned for this step: the scheduler reserves their slots
    draft_token_ids: list[int] = field(default_factory=list)  # proposals under verification
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), vocab], None = one-hot drafts
    # (position, [1, width]): the target's raw feature at its last computed position (the runner's;
    # the head makes its input of it where read), kept when an EAGLE head reads features (its row
    # position + 1 needs it); None until then
    last_feature: tuple[int, torch.Tensor] | None = None
    # (start, n, [[rows, width], ...]): an EAGLE head's rows [start, start + n) deferred from decode
    # steps, as their raw feature inputs f_{start-1} ... in the chunks the steps gave them (joined
    # once, when written: spec_methods/eagle.py); None when none wait
    head_pending: tuple[int, int, list[torch.Tensor]] | None = None
    # (token id, logprob, [(id, logprob)] most likely first) of the last tokens sampled, when
    # params.logprobs is set (Sampler); the engine hands them out with the tokens it appends
    new_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    detok: object | None = None  # chatserve.tokenizer.IncrementalDetokenizer
    grammar: GrammarMatcher | None = None  # what the output must match (params.json_schema); None = free text
    # A sibling with the same prompt (choice 0 of an n > 1 request) that computes it: this request
    # waits to be admitted until that one's prompt KV is committed, then attaches it from the prefix
    # cache instead of computing it again. None: no wait (or the wait is over).
    prompt_source: Request | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.stats.prompt_tokens = len(self.prompt_token_ids)
        if not self.stats.arrival_time:
            self.stats.arrival_time = time.perf_counter()
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed to the target: the rest of the prompt, or the last token."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while more than the last token is still to be fed to the target."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
