"""The static pass path: a KV cache of fixed slots written by position, and passes of a few fixed
shapes, each replayed as one captured CUDA graph on a GPU.

Why: on a GPU a decode or verify pass of a 1.5B model reads 3 GB of weights, about 1 ms at the
card's bandwidth, while eager `transformers` spends 35-60 ms launching its few hundred kernels
from Python (docs/gpu.md). A captured graph launches them all at once, but only for tensors that
never move and shapes that never change. So, as in gpt-fast:

- Each row owns a *slot*: per layer, keys and values [slots, kv heads, length, dim] allocated
  once. A token's keys are written at its position, so rejected drafts need no rollback: the next
  pass writes the tokens that replace them at the same positions, and a query attends to the
  positions up to its own (the mask is computed from the positions, on the device). The cache
  state of a row is just how many of its tokens are cached (`tokens[i]`).
- A pass feeds every slot `width` tokens, `width` one of WIDTHS (rows with fewer tokens are
  padded, free slots fed padding); the padding writes past the row's end or into the scratch
  positions at the end of each slot, where the next real token overwrites it before any query
  can see it.
- Prompts are prefilled in pieces of CHUNK tokens (a row's last one padded), up to
  `invariant.PREFILL_ROWS // CHUNK` pieces a pass, of one row or several: one more captured
  graph, whose rows each write the slot an index tensor names (two pieces of one row may share a
  pass: each attends to the keys up to its own positions, the other's written first). Eager, a
  prefill launches its thousand kernels from Python and waits on the device between them, a
  large share of a batch-1 job's time on a GPU (docs/gpu.md). A pass is one block of
  PREFILL_ROWS token rows, the dynamic path's prefill kernels, so a large batch prefills as many
  tokens per reading of the weights as an eager prefill does.
- Other passes wider than WIDTHS (a draft model catching up) run eagerly over their rows only,
  with the keys cut to the longest position: rare, and long enough to hide the launches.

Exactness: every layer runs the model's own modules (`transformers`' decoder layers, so the
row blocks of `invariant` apply), with the model's own attention function over the slots; only
the cache and the mask are ours. The result for a token is the dynamic path's (`BatchedLM`) bit
for bit: the kernel's attention (float32 on a CPU) skips masked keys, and float64 attention
absorbs the order in which it sums over them (`invariant`); tests/test_static_lm.py checks
logits and greedy outputs.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.decode.batched_lm import BatchedLM, _cache_keyword, _Prefix
from pipeline.decode.sampling import RowLogits
from pipeline.models import fixed_attention, fixed_linear, invariant, streamed
from pipeline.models.architecture import ADDITIVE, static_support

log = logging.getLogger(__name__)

# Widths (tokens per row) of the passes that replay a graph: a 1-token step, verify passes of up
# to 15 drafts. A pass of W tokens runs in the narrowest of these that holds it.
WIDTHS = (1, 2, 4, 8, 12, 16)
# Prompt tokens per piece: a prefill pass holds `invariant.PREFILL_ROWS // CHUNK` pieces.
CHUNK = 128
# Passes a round without drafts makes back to back on captured graphs (`greedy_steps`): the
# engine's round around a pass (~0.5 ms at 64 rows on a Zen 4 core, docs/engine.md) and the
# wait for the device come once per this many passes.
PLAIN_STEPS = 4


def wanted(model: PreTrainedModel) -> bool:
    """Does `model` run the static path? As `load_pair` decided (`models.static_passes`)."""
    return bool(getattr(model, "_static_passes", False))


def runner(model: PreTrainedModel, pad_token_id: int, vocab_size: int | None = None) -> BatchedLM:
    """The runner a model's passes go through: static where `load_pair` chose it, else dynamic."""
    if wanted(model):
        return StaticLM(model, pad_token_id, vocab_size)
    return BatchedLM(model, pad_token_id, vocab_size)


def piece_count(lengths) -> int:
    """The prefill pieces of prompts of these lengths (each cut in CHUNK tokens, its last piece
    padded), before any template start is reused."""
    return sum(-(-n // CHUNK) for n in lengths)


def width_of(tokens: int) -> int | None:
    """The graph width a pass of `tokens` tokens per row runs in (None: wider than any)."""
    return next((w for w in WIDTHS if w >= tokens), None)


class _Slots:
    """The static cache `transformers`' layers write through: `update` puts a pass's keys and
    values at their rows' slots and positions, and returns every key the pass may attend to.
    `layer(i)` is the same for layer i alone, for a compiled layer that must not see the others."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values
        self.rows: torch.Tensor | None = None  # slot per row of the pass; None: every slot in order
        self.positions: torch.Tensor | None = None  # [rows, width]
        self.seen = 0  # keys to return (0: all)

    def layer(self, i: int) -> _Slots:
        one = _Slots([self.keys[i]], [self.values[i]])
        one.rows, one.positions, one.seen = self.rows, self.positions, self.seen
        return one

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args, **kwargs):
        layer = 0 if len(self.keys) == 1 else layer
        held_keys, held_values = self.keys[layer], self.values[layer]
        rows = self.rows if self.rows is not None else torch.arange(len(held_keys), device=keys.device)
        index = (rows[:, None], slice(None), self.positions)  # -> [rows, width, kv heads, dim]
        held_keys[index] = keys.transpose(1, 2).to(held_keys.dtype)
        held_values[index] = values.transpose(1, 2).to(held_values.dtype)
        if self.rows is None and not self.seen:
            return held_keys, held_values
        seen = slice(None, self.seen or None)  # gathered only up to the last position a query sees
        return held_keys[rows, :, seen], held_values[rows, :, seen]


class _Store:
    """The static cache a model owns: its slots, and the graphs captured over them. Every runner
    of the model passes through the same ones (a bench's engines, the start-up calibration's,
    a job's engine), so each graph is captured once per model and slot size, not once per
    runner; runners of one model run one at a time."""

    def __init__(self, dtype: torch.dtype, compiled: bool):
        self.dtype, self.compiled = dtype, compiled
        self.capacity = self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.graphs: dict[int | str, _Graph] = {}  # by width; PREFILL: the prefill pass's
        self.kept: dict[int, tuple] = {}  # slots and graphs of other batch sizes, by size
        self.pool = None  # the memory pool every graph of the model shares (one runs at a time)
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.graphs_off: str | None = None  # why passes run eagerly on a GPU
        self.prefill_off: str | None = None  # why prefills do (decode passes may not)
        self.cache = _Slots(self.keys, self.values)  # rebound to every new buffer

    def switch(self, rows: int) -> None:
        """The slots and graphs of `rows` rows, as an earlier batch of that size left them (or
        none yet); the current ones kept for their size."""
        if self.capacity:
            self.kept[self.capacity] = (self.keys, self.values, self.graphs, self.length)
        self.keys, self.values, self.graphs, self.length = self.kept.pop(rows, ([], [], {}, 0))
        self.capacity = len(self.keys[0]) if self.keys else 0
        self.cache = _Slots(self.keys, self.values)

    def release(self) -> None:
        """Drop every slot and graph, this size's and those kept for others (`switch`). A batch
        that ran out of memory is retried at half its size (`_generate_fitting`), and `switch`
        would keep the slots of the size that did not fit beside the new ones."""
        self.kept.clear()
        self.keys, self.values, self.graphs = [], [], {}
        self.capacity = self.length = 0
        self.pool = None  # the graphs' memory, free once they are gone
        self.cache = _Slots(self.keys, self.values)

    def grow(self, layers: int, shape: tuple, device: torch.device, length: int) -> None:
        """New slots of `shape` per layer (rows, kv heads, positions, dim) holding the old ones'
        contents; the graphs captured over the old ones are dropped."""
        keys = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(layers)]
        if self.capacity:
            old, total = self.keys[0].shape[2], shape[2]
            for new, held in zip(keys + values, self.keys + self.values):
                new[: self.capacity, :, : min(old, total)] = held[:, :, : min(old, total)]
        self.keys, self.values = keys, values
        self.capacity, self.length = shape[0], length
        self.graphs.clear()  # they captured the old buffers
        self.cache = _Slots(self.keys, self.values)


class StaticLM(BatchedLM):
    """`BatchedLM`'s interface over fixed slots and fixed pass shapes (see the module docstring).

    `reserve(rows, length)` sizes the slots before a batch (the engine does it); a batch that
    needs more grows them, dropping the captured graphs. On a CPU the same passes run eagerly:
    that is how CI proves the path equal to the dynamic one.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, vocab_size: int | None = None):
        problem = static_support(model)
        if problem:
            raise ValueError(f"the static pass path cannot run this model: {problem}")
        self.row_slots: list[int] = []
        # every-slot passes run each decoder layer through `torch.compile`, fusing its few dozen
        # small kernels into a few before the graph captures them (`load_pair(compiled_passes=)`)
        self.compiled = bool(getattr(model, "_compiled_passes", False))
        implementation = model.config._attn_implementation
        # decode and verify passes attend in one fixed order per query (`fixed_attention`), over
        # a cache in the model's dtype, where the model is batch-invariant and a GPU runs it
        self.fixed_attention = fixed_attention.used(model)
        # else keys and values in the dtype the model's attention reads, as the dynamic path's cache
        cache_dtype = model.dtype if self.fixed_attention else invariant.cache_dtype(model) or model.dtype
        store = getattr(model, "_static_store", None)
        if store is None or store.dtype != cache_dtype or store.compiled != self.compiled:
            store = model._static_store = _Store(cache_dtype, self.compiled)
        self.store = store
        super().__init__(model, pad_token_id, vocab_size, pack=False)
        self._collected: dict[int, tuple[int, torch.Tensor]] = {}  # row -> features, within a pass
        self.use_graphs = self.device.type == "cuda"
        # a replayed pass costs about what the engine's round around it does: several back to back
        self.plain_steps = PLAIN_STEPS if self.use_graphs else 1
        if self.compiled and getattr(model, "_batch_invariant", False):
            # a wider pass would run eagerly, whose kernels round otherwise than the compiled ones
            self.max_verify_tokens = WIDTHS[-1]
        self.layers = list(model.base_model.layers)
        # the layers' own name for the cache (`transformers` renamed it; see `_cache_keyword`)
        self.cache_keyword = _cache_keyword(self.layers[0])
        self.additive = implementation in ADDITIVE
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    # the model's slots and graphs (`_Store`), read as the runner's own
    keys = property(lambda self: self.store.keys)
    values = property(lambda self: self.store.values)
    capacity = property(lambda self: self.store.capacity)
    length = property(lambda self: self.store.length)
    graphs = property(lambda self: self.store.graphs)
    cache = property(lambda self: self.store.cache)
    graphs_off = property(lambda self: self.store.graphs_off)

    def graph_record(self) -> dict:
        """What the graphs cost to capture, for stats and reports."""
        return {
            "graphs": sorted(w for w in self.graphs if w != PREFILL),
            "prefill_graph": PREFILL in self.graphs,
            "capture_seconds": round(self.store.capture_seconds, 3),
            "graph_bytes": self.store.graph_bytes,
            "slots": self.capacity,
            "slot_length": self.total,
            "eager_because": self.graphs_off if self.use_graphs else "no GPU",
            "prefill_eager_because": self.store.prefill_off,
            "compiled": self.compiled,
            "fixed_attention": self.fixed_attention,
            "fixed_linears": fixed_linear.used(self.model),
        }

    # --- slots -----------------------------------------------------------------------------

    def release(self) -> None:
        """Free the model's slots and graphs (`_Store.release`); the next `reserve` makes new ones."""
        self.row_slots, self.tokens = [], []
        self.store.release()

    def reserve(self, rows: int, length: int) -> None:
        """Slots for `rows` rows of up to `length` tokens (prompt, output and drafts), and the
        graph of every pass shape over them, captured now rather than at its first use: a width
        first used mid-run (once the policy drafts further, say) puts seconds of compiling and
        capturing into that run (docs/gpu.md).

        With no row running, the slots (and graphs) of exactly `rows` rows are used, kept from
        an earlier batch of that size where there was one: a graph pass costs every slot, so a
        batch of 1 must not run in the 64 slots a batch of 64 left."""
        self._size(rows, length)
        for width in (*WIDTHS, PREFILL):
            if self._graph(width) is None:
                break

    def _size(self, rows: int, length: int) -> None:
        """`reserve`'s slots, graphs left to their first use."""
        store = self.store
        if not self.row_slots and rows != store.capacity:
            store.switch(rows)
        rows, length = max(rows, store.capacity), max(length, store.length)
        if rows == store.capacity and length == store.length:
            return
        # room for the padding of the widest graph past a row's end, plus scratch positions at
        # the end where free slots' padding goes
        total = length + 2 * WIDTHS[-1]
        shape = (rows, self.kv_heads, total, self.head_dim)
        store.grow(len(self.layers), shape, self.device, length)

    @property
    def total(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def _free_slots(self) -> list[int]:
        used = set(self.row_slots)
        return [s for s in range(self.capacity) if s not in used]

    def _take(self, count: int, longest: int = 0) -> list[int]:
        """`count` free slots for new rows, growing the slots where needed."""
        free = self._free_slots()
        if len(free) < count or longest > self.length:
            # grown by half, so that a batch nobody reserved for is not copied every pass
            grown = max(int(longest * 1.5), 256) if longest > self.length else self.length
            self._size(len(self.row_slots) + count, grown)
            free = self._free_slots()
        return free[:count]

    def reset(self, batch_size: int) -> None:
        self.row_slots = []  # every slot free before taking
        self.row_slots = self._take(batch_size)
        self.tokens = [[] for _ in range(batch_size)]

    def add_rows(self, count: int) -> None:
        self.row_slots += self._take(count)
        self.tokens += [[] for _ in range(count)]

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tokens), default=0)

    def pass_tokens(self, lengths: list[int]) -> int:
        """A graph pass costs every slot the graph's width; an eager one its rows' rectangle."""
        longest = max(lengths, default=0)
        graph = width_of(longest)
        return self.capacity * graph if graph else len(lengths) * longest

    def _roll_back(self, row: int, keep: int) -> None:
        """As `BatchedLM._roll_back`: forgetting how many tokens are cached (rejected ones are
        overwritten in place)."""
        del self.tokens[row][keep:]

    def select(self, rows: list[int]) -> None:
        self.row_slots = [self.row_slots[r] for r in rows]
        self.tokens = [self.tokens[r] for r in rows]

    def compact(self, slack: float = 1.5, min_width: int = 64) -> None:
        """Nothing to squeeze: rejected tokens are overwritten in place."""

    # --- passes ----------------------------------------------------------------------------

    @torch.no_grad()
    def admit(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        """Prefill new rows into free slots beside the running ones."""
        start = len(self.tokens)
        self.add_rows(len(blocks))
        rows = list(range(start, start + len(blocks)))
        self._collected = {}
        with streamed.prefilling():
            logits = self._prefill_rows_at(rows, blocks, logits_per_row)
        self.features = [self._collected[r] for r in rows] if self.keep_features else []
        return logits

    @torch.no_grad()
    def forward(self, blocks: list[list[int]], logits_per_row: list[int]) -> list[torch.Tensor]:
        assert len(blocks) == len(self.tokens) and all(blocks), "one non-empty block per row"
        self._collected = {}
        if self.cold:
            with streamed.prefilling():
                logits = self._prefill_rows_at(list(range(len(blocks))), blocks, logits_per_row)
            self.features = [self._collected[r] for r in range(len(blocks))] if self.keep_features else []
            return logits
        self.fed_tokens = sum(map(len, blocks))
        self._take(0, max(len(t) + len(b) for t, b in zip(self.tokens, blocks)))
        logits: list[torch.Tensor] = [torch.empty(0)] * len(blocks)
        # rows of a draft catching up on whole prompts run eagerly, over those rows only
        wide = [i for i, b in enumerate(blocks) if len(b) > WIDTHS[-1]]
        narrow = [i for i, b in enumerate(blocks) if len(b) <= WIDTHS[-1]]
        if narrow:  # captured (and compiled) now where grown slots dropped it: not a pass's seconds
            self._graph(width_of(max(len(blocks[i]) for i in narrow)))
        began = time.perf_counter()
        for rows, run in ((wide, self._eager), (narrow, self._graph_pass)):
            if rows:
                got = run(rows, [blocks[i] for i in rows], [logits_per_row[i] for i in rows])
                for i, row_logits in zip(rows, got):
                    logits[i] = row_logits
                if len(rows) == len(blocks):  # every row in one pass: its logits as they came
                    logits = got
        self._timed(began)
        self.features = [self._collected[r] for r in range(len(blocks))] if self.keep_features else []
        return logits

    @torch.no_grad()
    def greedy_steps(self, tokens: list[int], steps: int) -> list[list[int]]:
        """As `BatchedLM.greedy_steps`, the passes back to back on the device: each pass's
        choices are written into the next pass's input there and read once at the end, as
        gpt-fast's decode loop does, so a GPU never waits for the host between them. The same
        width-1 every-slot passes and the same output layer over the same rows as `forward`'s,
        so the same choices."""
        if self.cold or self.keep_features:
            return super().greedy_steps(tokens, steps)
        rows = list(range(len(tokens)))
        self._take(0, max(len(t) for t in self.tokens) + steps)
        every = list(range(self.capacity))
        ids, positions = self._layout(every, rows, [[t] for t in tokens], 1, every_slot=True)
        ids, positions = ids.to(self.device), positions.to(self.device)
        slots = _on_device([self.row_slots[r] for r in rows], self.device)
        moving = torch.zeros_like(positions)  # the rows' slots move on a position a pass; the rest stay
        moving[slots] = 1
        graph = self._graph(1)
        chosen = []
        began = time.perf_counter()
        for _ in range(steps):
            hidden = graph.replay(ids, positions) if graph else self._layers(ids, positions, None, 0)
            choice = torch.argmax(self._head_logits(hidden[slots, 0]), dim=-1)
            chosen.append(choice)
            ids = ids.index_put((slots, torch.zeros_like(slots)), choice)
            positions = torch.clamp(positions + moving, max=self.total - 1)
        self._timed(began)
        self.fed_tokens = len(rows) * steps
        self.features = []
        choices = torch.stack(chosen, dim=1).tolist()
        for row, token, row_choices in zip(rows, tokens, choices):
            self.tokens[row] += [token, *row_choices[:-1]]
        return choices

    @torch.no_grad()
    def lookup_steps(
        self,
        tokens: list[int],
        gamma: int,
        steps: int,
        budgets: list[int] | None = None,
        ngrams: tuple[int, ...] = (3, 2, 1),
    ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        """`steps` greedy rounds of prompt lookup with the drafting and accepting on the device,
        the passes back to back: each row's drafts are the `gamma` tokens after the latest
        earlier occurrence of its last n tokens (n the longest of `ngrams` found), its verify
        pass one replay of width `gamma` + 1, and it keeps the drafts that equal the target's
        choices plus the target's next token, as `SpeculativeEngine._round` would. The host
        reads once, at the end: each row's tokens in order, and (drafted, accepted) per round.

        Why: at 64 rows a host-side round spent more time asking the drafters and accepting row
        by row than a captured GPU pass takes (docs/engine.md). Lossless as any greedy round: a
        token is kept only where the target chose it. Like `greedy_steps`, a row that ends
        early (EOS) rides the rest; the caller keeps its tokens up to its end. A row stops once
        it has its `budgets` tokens (its limit: its slot holds no more), its passes then writing
        scratch positions."""
        width = gamma + 1
        assert width in WIDTHS and not self.cold and not self.keep_features, "a graph width, warm rows"
        rows = list(range(len(tokens)))
        budgets = budgets or [steps * width] * len(rows)
        self._take(0, max(len(t) + min(b, steps * width) + width for t, b in zip(self.tokens, budgets)))
        slots = _on_device([self.row_slots[r] for r in rows], self.device)
        history = np.full((self.capacity, self.total), -1, dtype=np.int64)  # -1 matches no token
        known = np.zeros(self.capacity, dtype=np.int64)
        for row, token in zip(rows, tokens):
            seq = self.tokens[row] + [token]
            history[self.row_slots[row], : len(seq)] = seq
            known[self.row_slots[row]] = len(seq)
        history, known = torch.from_numpy(history).to(self.device), torch.from_numpy(known).to(self.device)
        active = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)
        active[slots] = True
        span = torch.arange(width, device=self.device)
        scratch = self.total - width + span  # free slots' positions (see `_layout`)
        graph = self._graph(width)
        left = torch.tensor(budgets, device=self.device)
        first, rounds = known.clone(), []
        began = time.perf_counter()
        for _ in range(steps):
            going = left > 0
            active[slots] = going
            drafts, counts = _lookup(history, known, gamma, ngrams)
            last = history.gather(1, (known - 1).clamp(min=0)[:, None])
            ids = torch.cat([last, drafts], dim=1)
            ids = torch.where(ids < 0, self.pad_token_id, ids)  # past a row's drafts, free slots
            positions = torch.where(active[:, None], (known - 1)[:, None] + span, scratch)
            positions = positions.clamp(max=self.total - 1)
            hidden = graph.replay(ids, positions) if graph else self._layers(ids, positions, None, 0)
            picked = hidden[slots].reshape(-1, hidden.shape[-1])
            choice = self._head_logits(picked).argmax(dim=-1).view(len(rows), width)
            agree = drafts[slots] == choice[:, :gamma]  # -1 past a row's drafts agrees with nothing
            accepted = agree.long().cumprod(dim=1).sum(dim=1)  # [rows]
            # the kept drafts, then the target's own token after them
            bonus = choice.gather(1, accepted[:, None])
            kept = torch.where(span[None, :gamma] < accepted[:, None], drafts[slots], -1)
            new = torch.cat([kept, torch.full_like(bonus, -1)], dim=1)
            new.scatter_(1, accepted[:, None], bonus)
            at = (known[slots, None] + span).clamp(max=self.total - 1)
            written = (new >= 0) & going[:, None]
            history[slots[:, None], at] = torch.where(written, new, history[slots[:, None], at])
            grown = torch.where(going, accepted + 1, 0)
            known[slots] += grown
            left -= grown
            outcome = torch.stack([counts[slots], accepted], dim=1)
            rounds.append(torch.where(going[:, None], outcome, 0))
        self._timed(began)
        self.fed_tokens = len(rows) * width * steps
        self.features = []
        start, end = first[slots].tolist(), known[slots].tolist()
        made = history[slots, : max(end, default=0)].tolist()  # not the slots' empty ends
        by_round = torch.stack(rounds, dim=1).tolist()  # [rows, steps, (drafted, accepted)]
        out, ran = [], []
        for n, (row, a, b) in enumerate(zip(rows, start, end)):
            out.append(made[n][a:b])
            self.tokens[row] = made[n][: b - 1]  # the last token is the next pass's to feed
            counted = list(itertools.accumulate(r[1] + 1 for r in by_round[n]))
            ran.append([tuple(r) for r, total in zip(by_round[n], counted) if total - r[1] - 1 < b - a])
        return out, ran

    def _prefill_rows_at(
        self, rows: list[int], blocks: list[list[int]], wanted: list[int]
    ) -> list[torch.Tensor]:
        """Prefill rows (nothing of them cached), each from its template start, in passes of
        pieces (see the module docstring); the logits of each row's last `wanted` tokens."""
        self._take(0, max(map(len, blocks)))
        self._graph(PREFILL)  # as `forward`'s: a capture is not a prefill's seconds
        began = time.perf_counter()
        self.fed_tokens = 0
        pieces: list[tuple[int, int, list[int]]] = []  # (row, offset in what it is fed, tokens)
        fed: dict[int, tuple[int, int, int]] = {}  # row -> (start position, tokens fed, wanted)
        for row, block, want in zip(rows, blocks, wanted):
            self.reusable(block, learn=True)
            seed = min(self.reusable(block), len(block) - want)
            self._seed_row(row, seed)
            fed[row] = (seed, len(block) - seed, want)
            self.fed_tokens += len(block) - seed
            pieces += [
                (row, at, block[seed + at : seed + at + CHUNK]) for at in range(0, len(block) - seed, CHUNK)
            ]
        picked: dict[int, list[torch.Tensor]] = {row: [] for row in rows}
        features: dict[int, list[torch.Tensor]] = {row: [] for row in rows}
        per_pass = max(invariant.PREFILL_ROWS // CHUNK, 1)
        self.prefill_passes = -(-len(pieces) // per_pass)
        for first in range(0, len(pieces), per_pass):
            group = pieces[first : first + per_pass]
            hidden = self._prefill_pass(group, per_pass, fed)
            for i, (row, at, piece) in enumerate(group):  # copied: a replay overwrites its output
                _, count, want = fed[row]
                keep = max(count - want - at, 0)
                if keep < len(piece):
                    picked[row].append(hidden[i, keep : len(piece)].clone())
                if self.keep_features:
                    features[row].append(hidden[i, : len(piece)].to(torch.float32, copy=True))
        for row, block in zip(rows, blocks):
            self.tokens[row] = list(block)
            if self.keep_features:
                found = features[row]
                self._collected[row] = (fed[row][0], torch.cat(found) if found else torch.empty(0))
        heads = [torch.cat(picked[row]) for row in rows if picked[row]]
        logits = self._head_logits(torch.cat(heads)) if heads else None
        out = list(logits.split([fed[row][2] for row in rows])) if logits is not None else []
        out = out or [torch.empty(0, self.vocab_size, device=self.device) for _ in rows]
        slot, n = self.row_slots[rows[0]], len(blocks[0])
        layers = [
            (k[slot : slot + 1, :, :n].clone(), v[slot : slot + 1, :, :n].clone())
            for k, v in zip(self.keys, self.values)
        ]
        self.previous = _Prefix(list(blocks[0]), layers)
        self._timed(began)
        return out

    def _prefill_pass(self, group: list[tuple[int, int, list[int]]], rows: int, fed: dict) -> torch.Tensor:
        """One prefill pass of `rows` pieces (the group's, then padding that writes scratch
        positions only; without a captured graph the group's alone, as a padded block computes
        the same bits for them on a GPU's row blocks and on a CPU's row-invariant kernels); the
        last hidden states [rows, CHUNK, hidden]."""
        graph = self._graph(PREFILL)
        rows = rows if graph is not None else len(group)
        ids = np.full((rows, CHUNK), self.pad_token_id, dtype=np.int64)
        positions = np.full((rows, CHUNK), self.total - 1, dtype=np.int64)
        slots = np.full(rows, self.row_slots[group[0][0]], dtype=np.int64)
        for i, (row, at, piece) in enumerate(group):
            ids[i, : len(piece)] = piece
            positions[i] = np.minimum(fed[row][0] + at + np.arange(CHUNK), self.total - 1)
            slots[i] = self.row_slots[row]
        ids, positions, slots = (torch.from_numpy(a) for a in (ids, positions, slots))
        if graph is not None:
            return graph.replay(ids, positions, slots)
        seen = int(positions.max()) + 1
        on = self.device
        return self._layers(ids.to(on), positions.to(on), slots.to(on), seen)

    def _seed_row(self, row: int, n: int) -> None:
        """Row `row` starts with the template's first n tokens (their keys and values copied)."""
        if not n:
            return
        slot = self.row_slots[row]
        for (k, v), keys, values in zip(self.template.head(n).layers, self.keys, self.values):
            keys[slot, :, :n] = k[0]
            values[slot, :, :n] = v[0]
        self.tokens[row] = list(self.template.tokens[:n])

    def _eager(self, rows: list[int], blocks: list[list[int]], wanted: list[int]) -> list[torch.Tensor]:
        """One eager pass over `rows` only, each fed its block (right-padded)."""
        width = max(map(len, blocks))
        ids, positions = self._layout(
            [self.row_slots[r] for r in rows], rows, blocks, width, every_slot=False
        )
        seen = int(positions.max()) + 1
        slots = torch.tensor([self.row_slots[r] for r in rows], device=self.device)
        hidden = self._layers(ids.to(self.device), positions.to(self.device), slots, seen)
        return self._finish(rows, blocks, wanted, hidden, list(range(len(rows))))

    def _graph_pass(self, rows: list[int], blocks: list[list[int]], wanted: list[int]) -> list[torch.Tensor]:
        """One pass of every slot at the graph width that holds the widest block."""
        width = width_of(max(map(len, blocks)))
        ids, positions = self._layout(list(range(self.capacity)), rows, blocks, width, every_slot=True)
        graph = self._graph(width)
        if graph is None:
            hidden = self._layers(ids.to(self.device), positions.to(self.device), None, 0)
        else:
            hidden = graph.replay(ids, positions)
        return self._finish(rows, blocks, wanted, hidden, [self.row_slots[r] for r in rows])

    def _layout(self, slots, rows, blocks, width, *, every_slot):
        """Token ids and positions [len(slots), width]: each row's block at the positions after
        its cached tokens, its padding after that; slots without a row in scratch positions."""
        # built in numpy, a row at a time: per-row torch calls cost ~2 ms a pass at batch 64, as
        # much as a captured GPU pass
        ids = np.full((len(slots), width), self.pad_token_id, dtype=np.int64)
        starts = np.full(len(slots), self.total - width, dtype=np.int64)
        for n, (row, block) in enumerate(zip(rows, blocks)):
            at = self.row_slots[row] if every_slot else n
            ids[at, : len(block)] = block
            starts[at] = len(self.tokens[row])
        # an eager group's short rows pad far: past the slot's end, padding shares its last position
        positions = np.minimum(starts[:, None] + np.arange(width), self.total - 1)
        return torch.from_numpy(ids), torch.from_numpy(positions)

    def _finish(self, rows, blocks, wanted, hidden: torch.Tensor, at: list[int]) -> list[torch.Tensor]:
        """The logits rows ask for, from the pass's last hidden states [slots, width, hidden];
        the fed tokens join their rows."""
        width = hidden.shape[1]
        flat = [a * width + c for a, b, n in zip(at, blocks, wanted) for c in range(len(b) - n, len(b))]
        picked = hidden.reshape(-1, hidden.shape[-1])[_on_device(flat, self.device)]
        logits = self._head_logits(picked)
        for row, block, a in zip(rows, blocks, at):
            if self.keep_features:  # copied: a replayed graph's output buffer is overwritten
                features = hidden[a, : len(block)].to(torch.float32, copy=True)
                self._collected[row] = (len(self.tokens[row]), features)
            self.tokens[row].extend(block)
        return RowLogits(logits, wanted)

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None, seen: int):
        """The model's decoder stack over [rows, width] tokens at `positions`, writing the slots
        (`slots`: one per row; None: every slot in order) and attending over the first `seen`
        positions (0: all). The last hidden states, after the final norm."""
        base = self.model.base_model
        hidden = base.embed_tokens(ids)
        cos_sin = base.rotary_emb(hidden, positions)
        length = seen or self.total
        # each query's keys are its slot's positions up to its own (`fixed_attention`), which
        # needs no mask (four kernels a pass fewer in the graph); not in prefills, whose
        # attention stays the float64 products
        counts, mask = None, None
        if self.fixed_attention and not streamed.is_prefilling():
            # a free slot's padding (its output never read) sits in the slot's scratch positions:
            # it attends to one key, not over the whole slot, which a draining batch's free
            # slots read every pass. No row's token reaches them (`_size`), nor its padding in a
            # graph pass; an eager group's short rows pad there, outputs never read either.
            free = positions >= self.total - WIDTHS[-1]
            counts = torch.where(free, 1, (positions + 1).clamp(max=length)).to(torch.int32)
        else:
            keys = torch.arange(length, device=self.device)
            mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [rows, 1, width, keys]
            if self.additive:
                blocked = torch.finfo(hidden.dtype).min
                mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=self.device).masked_fill(
                    ~mask, blocked
                )
        self.cache.rows, self.cache.positions, self.cache.seen = slots, positions, seen
        compiled = self.compiled and not seen
        for i, layer in enumerate(self.layers):
            cache = self.cache.layer(i) if compiled else self.cache
            run = _compiled_layer if compiled else _run_layer
            hidden = run(layer, hidden, mask, cos_sin, cache, self.cache_keyword, counts)
        return base.norm(hidden)

    @property
    def fixed_prefill(self) -> int:
        """Pieces a prefill pass holds where it replays one captured graph, which costs the same
        for one prompt's piece as for all of them (0 where prefills run eagerly, over their own
        pieces only)."""
        graphed = self.use_graphs and self.graphs_off is None and self.store.prefill_off is None
        return max(invariant.PREFILL_ROWS // CHUNK, 1) if graphed else 0

    def _graph(self, width: int | str) -> _Graph | None:
        """The captured graph of the every-slot pass of `width` tokens per row, or of a prefill
        pass (PREFILL), captured at first use; None where passes run eagerly."""
        if not self.use_graphs or self.graphs_off is not None:
            return None
        if width == PREFILL and self.store.prefill_off is not None:
            return None
        return self.graphs.get(width) or self._capture(width)

    @torch.no_grad()
    def _capture(self, width: int | str) -> _Graph | None:
        """Capture the pass `_graph` names as a CUDA graph (once). Without autograd, whoever
        asks (`reserve` runs outside the passes' `no_grad`): a graph captured with it keeps
        every activation its backward would need, and `torch.compile` compiles a forward that
        saves them, for as long as the graph lives (docs/gpu.md)."""
        began = time.perf_counter()
        free = torch.cuda.mem_get_info(self.device)[0]
        try:
            graph = _Graph(self, width)
        except torch.OutOfMemoryError:
            # not the kernels' fault: the batch does not fit, which the shard answers by halving
            # it (`_generate_fitting`); passes run eagerly from here would cost ten times as much
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            raise
        except Exception as error:  # a kernel that cannot be captured: run eagerly, and say why
            reason = f"{type(error).__name__}: {error}"[:300]
            if width == PREFILL:  # prompts prefill eagerly, decode passes keep their graphs
                self.store.prefill_off = reason
            else:
                self.store.graphs_off = reason
            log.warning("%s passes of this model run eagerly, not as CUDA graphs: %s", width, reason)
            torch.cuda.synchronize(self.device)
            return None
        self.graphs[width] = graph
        self.store.capture_seconds += time.perf_counter() - began
        self.store.graph_bytes += max(free - torch.cuda.mem_get_info(self.device)[0], 0)
        return graph


def _lookup(
    history: torch.Tensor, known: torch.Tensor, gamma: int, ngrams: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup as tensor ops, every slot at once: the `gamma` tokens after the latest
    earlier occurrence of a slot's last n tokens (n the longest of `ngrams` that occurs), and
    how many of them there are ([slots, gamma] with -1 past them, [slots]). `history` holds each
    slot's tokens, -1 past its `known` ones."""
    slots, length = history.shape
    device = history.device
    found = torch.zeros(slots, dtype=torch.bool, device=device)
    start = torch.zeros(slots, dtype=torch.long, device=device)
    for n in ngrams:
        tail = history.gather(1, (known[:, None] - n + torch.arange(n, device=device)).clamp(min=0))
        windows = history.unfold(1, n, 1)  # [slots, length - n + 1, n]
        at = torch.arange(windows.shape[1], device=device)
        # an occurrence with at least one token after it that is not the tail itself
        hit = (windows == tail[:, None, :]).all(dim=2) & (at[None, :] + n < known[:, None])
        hit &= (known >= n + 1)[:, None]
        latest = torch.where(hit, at[None, :], -1).max(dim=1).values
        new = (latest >= 0) & ~found
        start = torch.where(new, latest + n, start)
        found |= new
    counts = torch.where(found, (known - start).clamp(max=gamma), 0)
    index = (start[:, None] + torch.arange(gamma, device=device)).clamp(max=length - 1)
    drafts = history.gather(1, index)
    drafts = torch.where(torch.arange(gamma, device=device)[None, :] < counts[:, None], drafts, -1)
    return drafts, counts


def _run_layer(layer, hidden, mask, cos_sin, cache, keyword: str, visible=None) -> torch.Tensor:
    """One decoder layer of `transformers` over `hidden`, writing its keys and values to `cache`;
    `visible`: each query's count of keys, for `fixed_attention` (via `invariant_attention`)."""
    extra = {keyword: cache} if visible is None else {keyword: cache, "visible_keys": visible}
    out = layer(hidden, attention_mask=mask, position_embeddings=cos_sin, use_cache=True, **extra)
    return out[0] if isinstance(out, tuple) else out


def _compiled_layer(*args) -> torch.Tensor:
    global _compiled
    if _compiled is None:
        torch._dynamo.config.allow_unspec_int_on_nn_module = True  # one compile for every layer
        # Every pass shape (slots x width, and the prefill's) of the target and the draft is a
        # compile of its own. Past the limit a new shape would run eagerly, unsaid, and an eager
        # pass rounds otherwise than a compiled one: a verify width against target-only's.
        config = torch._dynamo.config
        for name, least in (
            ("cache_size_limit", COMPILED_SHAPES),
            ("accumulated_cache_size_limit", 4 * COMPILED_SHAPES),
        ):
            if hasattr(config, name):  # (names of torch 2.4 to 2.13, later aliases)
                setattr(config, name, max(getattr(config, name), least))
        _compiled = torch.compile(_run_layer, dynamic=False)
    return _compiled(*args)


_compiled = None
COMPILED_SHAPES = 1024  # pass shapes one process may compile (`_compiled_layer`)


PREFILL = "prefill"  # `_Store.graphs`' key for the graph of a prefill pass


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as an index on `device`, copied without waiting for the device: from pageable
    memory a copy first waits for every queued kernel (the whole replay), which kept the
    logits' kernels from queueing behind the graph (docs/gpu.md)."""
    index = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


class _Graph:
    """One captured pass: fixed input buffers, fixed output buffer. Every slot `width` tokens
    (a width), or (PREFILL) a prefill pass: `PREFILL_ROWS // CHUNK` rows of CHUNK tokens, each
    writing the slot an index tensor names at each replay."""

    def __init__(self, lm: StaticLM, width: int | str):
        prefill = width == PREFILL
        rows, width = (max(invariant.PREFILL_ROWS // CHUNK, 1), CHUNK) if prefill else (lm.capacity, width)
        self.ids = torch.full((rows, width), lm.pad_token_id, dtype=torch.long, device=lm.device)
        # warm-up and capture write scratch positions only, past any row's end
        scratch = torch.arange(lm.total - width, lm.total, device=lm.device)
        self.positions = scratch.clamp(min=lm.total - WIDTHS[-1]).repeat(rows, 1)
        self.slots = torch.zeros(rows, dtype=torch.long, device=lm.device) if prefill else None
        stream = torch.cuda.Stream(lm.device)
        stream.wait_stream(torch.cuda.current_stream(lm.device))
        # a prefill pass runs the prefill kernels (blocks of PREFILL_ROWS rows), compiled or not
        with torch.cuda.stream(stream), streamed.prefilling(prefill):
            for _ in range(2):  # warm-up: workspaces, lazy inits (writes scratch only)
                lm._layers(self.ids, self.positions, self.slots, 0)
        torch.cuda.current_stream(lm.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        if lm.store.pool is None:
            lm.store.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(self.graph, pool=lm.store.pool), streamed.prefilling(prefill):
            self.hidden = lm._layers(self.ids, self.positions, self.slots, 0)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None):
        self.ids.copy_(ids, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        if slots is not None:
            self.slots.copy_(slots, non_blocking=True)
        self.graph.replay()
        return self.hidden
