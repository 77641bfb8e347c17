"""A causal LM plus a ragged, rollback-able KV cache for a batch of rows.

Speculative decoding makes every row of a batch advance by a different number of tokens per
round, and throws away the cache entries of rejected draft tokens. Instead of re-laying the
cache out after every round, the cache here is an append-only rectangle of *slots*: each
forward pass appends one block of columns for the whole batch, and a per-row validity mask
says which slots hold tokens of that row's current sequence. Rejected tokens and padding
simply become invalid slots (holes). Keys already carry their rotary position, so holes cost
nothing but memory and attention width; `compact()` squeezes them out when they pile up.

Every row's tokens in a block come first and padding last ("right padding"), so every query
of every block can attend to at least one valid key and no attention row is fully masked.

The first pass of a batch (the prefill) is the costliest by far, and two things make it cheaper
without changing a bit of its result:
- On a CPU each row's prompt is prefilled in a pass of its own, then the rows' caches are
  laid side by side. A CPU is busy with one long prompt already; padding rows to the longest
  only adds work. A GPU prefills the batch in one padded pass.
- Prompts of a corpus job share a template (chat markup, system prompt, instruction). Once
  two different prompts have shown a common
  start, its keys and values are kept and copied into every later row that starts the same
  way, instead of being computed again (`reusable`).

Later passes are ragged (one row verifies 5 drafts, the next 1 token). On a CPU their weights'
products and attention run on the real tokens only (`packing`), and only the positions whose
logits a caller wants go through the output layer.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from pipeline.decode.sampling import RowLogits, greedy_choices
from pipeline.models import invariant, packing, streamed
from pipeline.models.architecture import plain_head
from pipeline.models.streamed import StreamedLinear

# A common start shorter than this is not worth keeping as a template (a BOS token, one word).
MIN_TEMPLATE = 8


@dataclass(frozen=True)
class _Prefix:
    """Some leading tokens of a prompt and their keys and values, per layer [1, heads, n, dim]."""

    tokens: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    def head(self, n: int) -> _Prefix:
        return _Prefix(self.tokens[:n], [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers])


def _common_start(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # most often, a prompt and the template it starts with: one comparison
        return n
    # halving on whole-prefix comparisons runs at C speed; a Python loop per token would not
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def agreeing(cached: list[int], seq: list[int], known: int = 0) -> int:
    """How many leading tokens of `cached` agree with `seq`, never `seq`'s last token (which
    must be fed again for its logits). `known`: leading tokens found to agree before, not
    compared again (0 where `cached` is shorter: nothing is assumed)."""
    keep = min(len(cached), len(seq) - 1)
    known = known if known <= keep else 0
    # disagreement sits at the tail (rejected drafts): shorten from the end past every token
    # that differs, then compare the rest of the prefix at C speed, rather than walking every
    # token from the start in Python
    while keep > known and cached[keep - 1] != seq[keep - 1]:
        keep -= 1
    if (
        keep > known
        and (cached if keep == len(cached) and not known else cached[known:keep]) != seq[known:keep]
    ):
        keep = known + _common_start(cached[known:keep], seq[known:keep])  # a disagreement further in
    return keep


class BatchedLM:
    """Runs `model` over ragged blocks of tokens for a batch of rows, keeping a slot cache."""

    # Prompt pieces a prefill pass holds where it costs the same whatever it holds (a captured
    # graph, `StaticLM`); 0: a prefill costs by its tokens, as here.
    fixed_prefill = 0
    # Passes a round without drafts makes back to back by default (`EngineConfig.plain_steps`):
    # one here, where a pass costs far more than the engine's round around it.
    plain_steps = 1

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        vocab_size: int | None = None,
        *,
        per_row_prefill: bool | None = None,
        pack: bool | None = None,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        # logits are cut to this width (target and draft embeddings may be padded differently)
        self.vocab_size = vocab_size or model.get_output_embeddings().out_features
        self.device = next(model.parameters()).device
        # the most tokens a row's decode or verify pass may feed and keep its numerics (None: any)
        self.max_verify_tokens: int | None = None
        self.forward_seconds = 0.0
        # each row's cache list at the last `sync`: (it, the sequence synced, tokens agreeing)
        self._agreed: dict[int, tuple[list[int], list[int], int]] = {}
        # host work no pass's result changes, run while a device's pass runs (the host would
        # only wait for it): called with the pass's start (`time.perf_counter`), set by the engine
        self.meanwhile: Callable[[float], None] | None = None
        self.fed_tokens = 0  # tokens the last `forward` computed (not padding, not reused ones)
        self.prefill_passes = 0  # passes the last prefill (`admit`, a cold `forward`) took
        # None: one prefill pass per row on a CPU, one padded pass for the batch elsewhere
        self.per_row_prefill = self.device.type == "cpu" if per_row_prefill is None else per_row_prefill
        # None: ragged passes skip their padding on a CPU (see `packing`); a GPU pays no
        # more for the padding than for the gathers that would skip it
        self.pack = self.device.type == "cpu" if pack is None else pack
        if self.pack:
            packing.install(model)
        self.template: _Prefix | None = None  # a start shared by two different prompts
        self.previous: _Prefix | None = None  # the last prompt prefilled, to find templates with
        self.head_rows: torch.Tensor | None = None  # see restrict_head
        self.cache_keyword = _cache_keyword(model)
        # With `keep_features`, each pass leaves in `features` the last hidden states (after the
        # final norm) of every token it fed, per row of the pass (for `admit`: the new rows), as
        # (position of the first, [tokens, hidden] float32): what a draft head reads.
        self.keep_features = False
        self.features: list[tuple[int, torch.Tensor]] = []
        self._hidden: torch.Tensor | None = None
        self.reset(0)

    def _new_cache(self) -> DynamicCache:
        """An empty cache whose layers write each pass's keys and values into room kept for them
        (`_Room`) rather than concatenating the whole cache again, in the dtype the model's
        attention reads (`invariant.cache_dtype`: float64 for float64 attention, converted as
        they arrive rather than the whole cache again in every pass)."""
        cache = DynamicCache(config=self.model.config)
        dtype = invariant.cache_dtype(self.model)
        for layer in cache.layers:
            if type(layer) is DynamicLayer:
                layer.update = _Room(layer, dtype).update
        return cache

    def reserve(self, rows: int, length: int) -> None:
        """Room for `rows` rows of `length` tokens; this cache grows as it goes (see `StaticLM`)."""

    def restrict_head(self, rows: torch.Tensor | None) -> None:
        """Compute logits only for the token ids `rows` (others get -inf); None: all of them.

        For a draft model: its output layer over a 152k vocabulary is a large share of a small
        model's step, while its proposals come from a much smaller set of likely tokens. The
        weight rows are gathered once here.
        """
        self.head_rows = rows
        self._head = None
        if rows is not None:
            head = self.model.get_output_embeddings()
            some = nn.Linear(head.in_features, len(rows), bias=getattr(head, "bias", None) is not None)
            some.weight = nn.Parameter(head.weight[rows.to(head.weight.device)], requires_grad=False)
            if some.bias is not None:
                some.bias = nn.Parameter(head.bias[rows], requires_grad=False)
            # a model whose Linear layers stream (float32 on AVX2 CPUs) streams this one too
            streams = getattr(self.model, "_streamed", None) and head.in_features % 8 == 0
            self._head = StreamedLinear(some, int8=self.model._streamed == "int8") if streams else some

    def reset(self, batch_size: int) -> None:
        """Start an empty cache for `batch_size` rows."""
        self.cache = self._new_cache()
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.slots: list[list[int]] = [[] for _ in range(batch_size)]

    @torch.no_grad()
    def admit(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        """Prefill new rows and append them to the batch (continuous batching).

        The new rows' prefill runs as a batch of its own (per row on a CPU), then its cache is
        laid beside the running rows' one; logits as `forward` gives them.
        """
        if not self.tokens:
            self.reset(len(blocks))
            return self.forward(blocks, logits_per_row)
        running = (self.cache, self.mask, self.tokens, self.slots)
        logits = self._prefill(blocks, logits_per_row)
        self._merge([running, (self.cache, self.mask, self.tokens, self.slots)])
        return logits

    def add_rows(self, count: int) -> None:
        """Append `count` rows with nothing cached: their next pass feeds their whole sequence.

        For a draft model, whose new rows can catch up inside its next step (packed on a CPU,
        so the running rows' single tokens do not wait for a padded prefill).
        """
        if self.width:
            for layer in self.cache.layers:
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, *layer.keys.shape[1:])])
                layer.values = torch.cat(
                    [layer.values, layer.values.new_zeros(count, *layer.values.shape[1:])]
                )
        self.mask = torch.cat([self.mask, self.mask.new_zeros(count, self.width)])
        self.tokens += [[] for _ in range(count)]
        self.slots += [[] for _ in range(count)]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def pass_tokens(self, lengths: list[int]) -> int:
        """What a pass over blocks of these lengths costs, in tokens: the real ones when
        packed, else the whole rectangle (padding included)."""
        return sum(lengths) if self.pack else len(lengths) * max(lengths, default=0)

    def _timed(self, began: float) -> None:
        """A pass launched at `began` ends: `meanwhile` runs first, then the host waits for the
        device, and the pass's seconds count."""
        if self.meanwhile is not None:
            self.meanwhile(began)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - began

    @property
    def cold(self) -> bool:
        """Nothing cached yet: the next pass is a prefill."""
        return self.width == 0

    def sync(self, seqs: list[list[int]]) -> list[list[int]]:
        """Roll each row's cache back to its longest prefix agreeing with `seqs[i]`.

        Returns, per row, the tokens of `seqs[i]` that are not in the cache yet (what the next
        `forward` must feed; at least the last token, whose logits the caller wants). This one
        rule covers rejected drafts, bonus tokens and rows whose drafts came from elsewhere.
        A row's sequence given again as the same list must only have grown since (the engine's
        rows' do): what agreed of it then is not compared again (`_agreeing`).
        """
        unfed, agreed = [], {}
        for i, seq in enumerate(seqs):
            cached = self.tokens[i]
            keep = self._agreeing(i, seq)
            if keep < len(cached):
                self._roll_back(i, keep)
            agreed[id(cached)] = (cached, seq, keep)
            unfed.append(seq[keep:])
        self._agreed = agreed
        return unfed

    def _roll_back(self, row: int, keep: int) -> None:
        """Forget what `row` cached past its first `keep` tokens."""
        dropped = self.slots[row][keep:]
        self.mask[row, dropped] = 0
        del self.tokens[row][keep:]
        del self.slots[row][keep:]

    def catch_up_tokens(self, seqs: list[list[int]]) -> int:
        """What the pass after `sync(seqs)` would cost in tokens (see `pass_tokens`): a draft
        that fell behind pays this before its next proposal."""
        return self.pass_tokens([len(seq) - self._agreeing(i, seq) for i, seq in enumerate(seqs)])

    def reusable(self, seq: list[int], learn: bool = False) -> int:
        """Leading tokens of `seq` whose keys and values a prefill copies from the template.

        A template is a start that two *different* prompts shared (they diverge after it); with
        `learn`, `seq` and the previous prompt may set a longer one. A prompt identical to the
        one before it reuses only the template, not its twin's whole cache: the target-only
        check re-decodes rows it has just decoded, and must pay what a new row pays.
        """
        shared = _common_start(seq, self.template.tokens) if self.template else 0
        if learn and self.previous is not None:
            common = _common_start(seq, self.previous.tokens)
            if shared < common < min(len(seq), len(self.previous.tokens)) and common >= MIN_TEMPLATE:
                self.template, shared = self.previous.head(common), common
        return min(shared, len(seq) - 1)  # the last token is fed, for its logits

    def prefill_tokens(self, seqs: list[list[int]]) -> int:
        """Tokens a prefill of `seqs` from a cold cache would compute (what a catch-up costs)."""
        return sum(len(seq) - self.reusable(seq) for seq in seqs)

    def _agreeing(self, row: int, seq: list[int]) -> int:
        """Leading cached tokens of `row` that agree with `seq`; never its last token, which
        must be fed again for its logits. What agreed at the last `sync` is not compared
        again where the row's cache and `seq` are the same lists as then: at 64 rows of 2,000
        tokens comparing every row's whole prefix cost 0.66 ms a round, each sync and each
        draft catch-up's pricing, beside a captured GPU pass of a few (docs/engine.md)."""
        cached = self.tokens[row]
        held = self._agreed.get(id(cached))
        known = held[2] if held is not None and held[0] is cached and held[1] is seq else 0
        return agreeing(cached, seq, known)

    @torch.no_grad()
    def forward(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        """Append one block per row to the cache and return the logits each row asks for.

        `blocks[i]` must be non-empty; `logits_per_row[i]` is how many trailing positions of
        row i need next-token logits (float32, shape [n_i, vocab]). Only those positions go
        through the LM head, which matters for long prompts and large vocabularies.
        """
        assert len(blocks) == len(self.tokens) and all(blocks), "one non-empty block per row"
        if self.cold:
            return self._prefill(blocks, logits_per_row)
        self.fed_tokens = sum(map(len, blocks))
        return self._append(blocks, logits_per_row)

    def greedy_steps(self, tokens: list[int], steps: int) -> list[list[int]]:
        """`steps` one-token passes, each row fed `tokens[i]` first, then its own greedy choice
        of the pass before: each row's `steps` choices. The passes `forward` makes one round at
        a time, without the rounds around them; a static runner keeps them on the device."""
        chosen: list[list[int]] = [[] for _ in tokens]
        for _ in range(steps):
            logits = self.forward([[t] for t in tokens], [1] * len(tokens))
            tokens = [row[0] for row in greedy_choices(logits, False)[0]]
            for row, token in zip(chosen, tokens):
                row.append(token)
        return chosen

    def _prefill(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        """The first pass of a batch: per row or all together, each from its template start.
        Marked as a prefill for the kernels (`streamed.prefilling`)."""
        with streamed.prefilling():
            return self._prefill_rows(blocks, logits_per_row)

    def _prefill_rows(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        groups = [[i] for i in range(len(blocks))] if self.per_row_prefill else [list(range(len(blocks)))]
        logits: list[torch.Tensor] = [torch.empty(0)] * len(blocks)
        features: list = [None] * len(blocks)
        states = []
        self.fed_tokens, self.prefill_passes = 0, len(groups)
        for group in groups:
            rows = [blocks[i] for i in group]
            wanted = [logits_per_row[i] for i in group]
            for b in rows:
                self.reusable(b, learn=True)
            seed = min(min(self.reusable(b), len(b) - n) for b, n in zip(rows, wanted))
            self._seed(len(group), seed)
            for n, (i, row_logits) in enumerate(zip(group, self._append([b[seed:] for b in rows], wanted))):
                logits[i] = row_logits
                features[i] = self.features[n] if self.keep_features else None
            self.fed_tokens += sum(len(b) - seed for b in rows)
            states.append((self.cache, self.mask, self.tokens, self.slots))
            n = len(rows[0])
            layers = [(layer.keys[:1, :, :n], layer.values[:1, :, :n]) for layer in self.cache.layers]
            self.previous = _Prefix(list(rows[0]), layers)
        if len(states) > 1:
            self._merge(states)
        self.features = features if self.keep_features else []
        return logits

    def _seed(self, rows: int, n: int) -> None:
        """An empty batch of `rows` rows whose caches start with the template's first n tokens."""
        self.reset(rows)
        if n:
            for index, (k, v) in enumerate(self.template.head(n).layers):
                self.cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), index)
            self.mask = torch.ones(rows, n, dtype=torch.long, device=self.device)
            self.tokens = [list(self.template.tokens[:n]) for _ in range(rows)]
            self.slots = [list(range(n)) for _ in range(rows)]

    def _merge(self, states: list[tuple]) -> None:
        """Lay groups' caches side by side, each right-padded with invalid slots to the widest."""
        width = max(mask.shape[1] for _, mask, _, _ in states)
        pad = torch.nn.functional.pad
        self.cache = self._new_cache()
        for index in range(len(states[0][0].layers)):
            layers = [cache.layers[index] for cache, _, _, _ in states]  # [rows, heads, slots, dim]
            keys = torch.cat([pad(la.keys, (0, 0, 0, width - la.keys.shape[2])) for la in layers])
            values = torch.cat([pad(la.values, (0, 0, 0, width - la.values.shape[2])) for la in layers])
            self.cache.update(keys, values, index)
        self.mask = torch.cat([pad(mask, (0, width - mask.shape[1])) for _, mask, _, _ in states])
        self.tokens = [t for _, _, tokens, _ in states for t in tokens]
        self.slots = [s for _, _, _, slots in states for s in slots]

    def _append(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        """Run one pass over a block per row, appending it to the cache."""
        width = max(len(b) for b in blocks)
        batch = len(blocks)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        block_mask = torch.zeros((batch, width), dtype=torch.long)
        wanted: list[int] = []  # flat positions (row * width + column) that need logits
        for i, block in enumerate(blocks):
            n = len(block)
            start = len(self.tokens[i])
            ids[i, :n] = torch.tensor(block)
            positions[i, :n] = torch.arange(start, start + n)
            positions[i, n:] = start + n - 1
            block_mask[i, :n] = 1
            wanted.extend(i * width + c for c in range(n - logits_per_row[i], n))

        base = self.width
        attention = torch.cat([self.mask, block_mask.to(self.device)], dim=1)
        inputs = {
            "input_ids": ids.to(self.device),
            "attention_mask": attention,
            "position_ids": positions.to(self.device),
            self.cache_keyword: self.cache,
            "use_cache": True,
        }
        lengths = [len(b) for b in blocks]
        layout = None
        if self.pack and sum(lengths) < batch * width:
            layout = packing.Layout.of(lengths, width, self.device)
        began = time.perf_counter()
        logits = self._logits(inputs, torch.tensor(wanted, device=self.device), layout)
        self._timed(began)

        self.mask = attention
        if self.keep_features:
            self.features = [
                (len(self.tokens[i]), self._hidden[i, : len(b)].to(torch.float32, copy=True))
                for i, b in enumerate(blocks)
            ]
        for i, block in enumerate(blocks):
            self.tokens[i].extend(block)
            self.slots[i].extend(range(base, base + len(block)))
        return RowLogits(logits, logits_per_row)

    def _logits(self, inputs: dict, wanted: torch.Tensor, layout: packing.Layout | None) -> torch.Tensor:
        """Float logits [len(wanted), vocab] at the flat positions `wanted` of the pass.

        Only those positions go through the output layer: a 152k-token vocabulary makes it
        dear, and even converting a padded rectangle's logits to float is not free. Models
        whose logits are more than the output layer of the last hidden states (soft-capped,
        scaled) run their own forward instead (see `architecture.plain_head`).
        """
        with packing.packed(layout):
            if self.head_rows is None and not plain_head(self.model) and not self.keep_features:
                width = inputs["input_ids"].shape[1]
                rows, cols = wanted // width, wanted % width
                columns = torch.unique(cols)  # sorted
                rect = self.model(**inputs, logits_to_keep=columns).logits
                return rect[rows, torch.searchsorted(columns, cols), : self.vocab_size].float()
            hidden = self.model.base_model(**inputs).last_hidden_state
        self._hidden = hidden if self.keep_features else None
        return self._head_logits(hidden.reshape(-1, hidden.shape[-1])[wanted])

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits [rows, vocab] of last hidden states [rows, hidden] (see `restrict_head`)."""
        if self.head_rows is None:
            return self.model.get_output_embeddings()(hidden)[:, : self.vocab_size].float()
        some = self._head(hidden).float()
        logits = some.new_full((some.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.head_rows] = some
        return logits

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (finished rows stop costing compute). No rows left: a cold cache,
        so that rows added next start with a prefill (and its template), not a catch-up."""
        if len(rows) == len(self.tokens):
            return
        if not rows:
            self.reset(0)
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.width:
            self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.tokens = [self.tokens[r] for r in rows]
        self.slots = [self.slots[r] for r in rows]
        self.compact()

    def compact(self, slack: float = 1.5, min_width: int = 64) -> None:
        """Squeeze out holes once the cache is much wider than the longest row needs."""
        longest = max((len(t) for t in self.tokens), default=0)
        if self.width <= max(min_width, slack * longest):
            return
        gather = torch.zeros(len(self.tokens), longest, dtype=torch.long)
        mask = torch.zeros(len(self.tokens), longest, dtype=torch.long)
        for i, slots in enumerate(self.slots):
            gather[i, : len(slots)] = torch.tensor(slots, dtype=torch.long)
            mask[i, : len(slots)] = 1
            self.slots[i] = list(range(len(slots)))
        gather = gather.to(self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    "sliding-window attention caches are not supported by the speculative engine"
                )
            idx = gather[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, idx)
            idx = gather[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[-1])
            layer.values = layer.values.gather(2, idx)
        self.mask = mask.to(self.device)


class _Room:
    """A cache layer's keys and values as the first columns of buffers with room to grow.

    Why: `DynamicLayer.update` concatenates, copying every cached key and value of every layer in
    every pass; for the 1.5B target at 400 cached tokens that was ~12 ms of a ~130 ms decode pass
    on a CPU (float64 keys, see `_new_cache`). Here a pass writes its own columns only; the
    buffers grow by half when full. Whatever replaces the layer's tensors (the runner selects,
    merges, compacts) is taken as the new start: the next update copies it into new buffers, so
    columns another tensor may view (a template's) are never written again.
    """

    GROWTH, MIN_ROOM = 1.5, 64

    def __init__(self, layer: DynamicLayer, dtype: torch.dtype | None):
        # the layer holds our `update`: a strong reference back would be a cycle, and a dropped
        # cache would wait for the garbage collector to free its buffers
        self.layer, self.dtype = weakref.ref(layer), dtype
        self.keys = self.values = None  # the buffers; layer.keys/.values view their first columns
        self.length = 0  # how many

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        layer = self.layer()
        if self.dtype is not None:
            keys, values = keys.to(self.dtype), values.to(self.dtype)
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        held, n, m = layer.keys, 0, keys.shape[-2]
        if held.dim() == 4:
            n = held.shape[-2]
        ours = (
            self.keys is not None
            and held.data_ptr() == self.keys.data_ptr()
            and layer.values.data_ptr() == self.values.data_ptr()
            and self.keys.shape[:2] == keys.shape[:2]
            and held.stride() == self.keys.stride()
            and n == self.length
        )
        if not ours or self.keys.shape[-2] < n + m:
            size = max(int(self.GROWTH * (n + m)), n + m + self.MIN_ROOM)
            shape = (*keys.shape[:2], size, keys.shape[-1])
            self.keys, self.values = keys.new_empty(shape), values.new_empty((*shape[:3], values.shape[-1]))
            if n:
                self.keys[:, :, :n] = held
                self.values[:, :, :n] = layer.values
        self.keys[:, :, n : n + m] = keys
        self.values[:, :, n : n + m] = values
        layer.keys, layer.values = self.keys[:, :, : n + m], self.values[:, :, : n + m]
        self.length = n + m
        return layer.keys, layer.values


def _cache_keyword(model: PreTrainedModel) -> str:
    """The forward argument that takes the KV cache.

    transformers renamed `past_key_values` to `cache` in 5.24 and warns on the old name until
    it is removed in 5.40; models written for older releases only know the old one.
    """
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
