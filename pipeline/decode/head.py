"""A draft head on the target's own features (EAGLE's design): one decoder layer of the target's
shape that drafts from the target's last hidden states rather than from the tokens alone.

Why: the drafters that cost nothing copy their input, and a translation does not repeat its
input; the draft model translates but pays a second model's prefill and a pass of its own per
token. The target's last hidden state at a position already holds what the target is about to
say next, so a single layer that reads it can guess a few tokens further at a fraction of a
pass, and its cache over the prompt is built from features the target's prefill computed
anyway: no second model reads the prompt.

The head (`DraftHead`): at position i it reads the pair (f_i, x_{i+1}), the target's feature
at i (its last hidden state, after the final norm: what the output layer reads) and the
embedding of the next token, through `fc` (2H -> H) and one decoder layer, and gives g_i, its
guess at f_{i+1}; the target's own output layer over a reduced vocabulary (`vocab_rows`) turns
g_i into a guess at x_{i+2}. Drafting γ tokens past an accepted sequence x_0..x_{L-1}: the
pairs up to i = L-2 come with true features; the first draft is read from g_{L-2}; each further
step feeds the head's own g in place of the feature the target has not computed yet. After the
target's verify pass, the drafted pairs are dropped from the head's cache and the accepted ones
fed again with the target's true features.

Trained (`train`) by teacher forcing on a run's own documents: the target's features over each
prompt and completion (one forward pass per document, no gradient), labels the target's own
next tokens; cross-entropy on the completion's tokens plus a smooth-L1 pull of g_i towards
f_{i+1}. A head trained so on true features alone drafts a first token and little after it:
its own g is not the feature it learned from. So each document also trains the later draft
steps as the chain runs them, fed the head's own outputs (EAGLE-3's training-time test,
`_teacher_forced` with `steps`).

The embedding, rotary tables and output layer are the target's, borrowed at `bind` and never
trained or saved: a saved head is its `fc` and its layer, plus the target's fingerprint, which
`load` checks.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from pipeline.decode.costs import RunningRate, ema
from pipeline.decode.settings import HEAD
from pipeline.models import fusion

HEAD_FILE = "head.safetensors"
HEAD_CONFIG = "head.json"
HEAD_FORMAT = 1
# the draft steps a head learns at every pair, chained on its own outputs (`_teacher_forced`);
# why this many: docs/choosing-a-draft.md
CHAINED_STEPS = 3


class HeadError(ValueError):
    """A head that cannot be used with this target; the message says why."""


def target_fingerprint(target: PreTrainedModel) -> str:
    """What a head depends on in its target: the architecture's shape and its output layer's
    and embedding's values (a head trained on another target's features is useless), these
    rounded to bfloat16: the same target loaded in another dtype (trained on bf16 features,
    served in float32) is the same target."""
    config = target.config
    shape = [type(target).__name__, config.hidden_size, config.num_hidden_layers, config.vocab_size]
    digest = hashlib.sha256(json.dumps(shape).encode())
    weight = target.get_input_embeddings().weight.detach()  # an embedding is never repacked
    sample = weight[:: max(1, weight.shape[0] // 64)].to(torch.bfloat16).float()
    digest.update(sample.cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


@torch.no_grad()
def output_rows(target: PreTrainedModel, rows: torch.Tensor) -> torch.Tensor:
    """The target's output layer's weight rows `rows` [len(rows), H], float32, whatever holds
    them (see `_weight_rows`)."""
    return _weight_rows(target.get_output_embeddings(), target.config.hidden_size, rows)


@torch.no_grad()
def _weight_rows(
    layer: torch.nn.Module, in_features: int, rows: torch.Tensor | None = None, chunk: int = 256
) -> torch.Tensor:
    """A linear layer's weight rows `rows` (None: all), float32: its `weight` where it has one,
    else read back from a kernel's packed blocks (`StreamedLinear`, `BlockLinear`) by applying
    the layer to unit vectors (w·e_j is w_j exactly; the bias taken off)."""
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor):
        weight = weight.detach()
        return (weight if rows is None else weight[rows.to(weight.device)]).float().contiguous()
    bias = layer(torch.zeros(1, in_features))[0]
    parts = []
    for begin in range(0, in_features, chunk):
        units = torch.eye(in_features)[begin : begin + chunk]
        out = layer(units) - bias  # [chunk, out]
        parts.append(out if rows is None else out[:, rows])
    return torch.cat(parts).T.contiguous()


@torch.no_grad()
def _copy_layer(source: torch.nn.Module, into: torch.nn.Module) -> None:
    """`into`'s weights from `source`, a module of the same class: the state as it is where
    `source` holds plain weights, else each Linear's read back from the kernel's blocks."""
    state = source.state_dict()  # a fused layer's holds its fused products too (`fusion`)
    try:
        into.load_state_dict({key: state[key] for key in into.state_dict()})
        return
    except (KeyError, RuntimeError):
        pass
    found = dict(source.named_modules())
    for name, module in into.named_modules():
        if isinstance(module, torch.nn.Linear):
            layer, rows = found[name], None
            if isinstance(layer, fusion.Part):  # rows of a product it shares (the blocks' q, k, v)
                layer, rows = getattr(found[name.rpartition(".")[0]], layer._fused_into), layer.rows
            module.weight.copy_(_weight_rows(layer, module.in_features, rows))
            if module.bias is not None:
                bias = layer(torch.zeros(1, module.in_features))[0]
                module.bias.copy_(bias if rows is None else bias[rows])
        else:  # a norm's weight, say
            for key, value in module.named_parameters(recurse=False):
                value.copy_(getattr(found[name], key).detach())


class DraftHead(torch.nn.Module):
    """`fc` and one decoder layer of the target's kind; see the module docstring."""

    def __init__(self, config, layer_class: type, vocab_rows: torch.Tensor, fingerprint: str):
        super().__init__()
        config = copy.deepcopy(config)
        config._attn_implementation = "sdpa"
        self.config = config
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_class(config, layer_idx=0)
        self.register_buffer("vocab_rows", vocab_rows.long(), persistent=False)
        self.fingerprint = fingerprint
        self._lm: torch.Tensor | None = None
        self.steps_before = 0  # training steps it had when loaded (its config's `steps`)

    @classmethod
    def from_target(
        cls, target: PreTrainedModel, vocab: int | None = 0, rows: Sequence[int] = ()
    ) -> DraftHead:
        """A new head for `target`: its layer a copy of the target's last one (a better start
        than random for a layer that must compute one more step of the same stack), proposing
        token ids below `vocab` (0: all; None: none) and `rows`."""
        last = target.base_model.layers[-1]
        vocab_rows = _vocab_rows(target, vocab, rows)
        head = cls(target.config, type(last), vocab_rows, target_fingerprint(target))
        head.to(dtype=torch.float32)
        _copy_layer(last, head.layer)
        with torch.no_grad():  # start as "the feature, moved a little by the token"
            hidden = target.config.hidden_size
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, hidden:] += torch.eye(hidden)
        return head.bind(target)

    def bind(self, target: PreTrainedModel) -> DraftHead:
        """Borrow the target's embedding, rotary tables and output layer (over `vocab_rows`)."""
        if target_fingerprint(target) != self.fingerprint:
            raise HeadError(
                "this draft head was trained on another target's features (fingerprint "
                f"{self.fingerprint}, this target's {target_fingerprint(target)}): train one for "
                "this target with `pipeline distill --head`"
            )
        # set past nn.Module's attribute hook: borrowed, so neither trained, saved nor moved
        self.__dict__["_embed"] = target.get_input_embeddings()
        self.__dict__["_rotary"] = target.base_model.rotary_emb
        self._lm = output_rows(target, self.vocab_rows)
        return self.to(self._lm.device)

    @property
    def device(self) -> torch.device:
        return self.vocab_rows.device  # a buffer: the linears' weights go when packed

    def digest(self) -> str:
        """A short hash of the trained weights: which head a job's actors drafted with, so a
        head passed from job to job (`drafter.head_online`) can be followed."""
        digest = hashlib.sha256()
        for name, value in sorted(self.state_dict().items()):
            digest.update(name.encode())
            digest.update(value.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def snapshot(self) -> DraftHead:
        """A copy of the weights, borrowing what this head borrows (no second copy of the
        target's output rows): what a job drafts with, packed, while this head goes on learning
        (`OnlineHead`)."""
        twin = DraftHead(self.config, type(self.layer), self.vocab_rows.cpu(), self.fingerprint)
        twin.load_state_dict(self.state_dict())
        twin.__dict__.update(_embed=self.__dict__["_embed"], _rotary=self.__dict__["_rotary"])
        twin._lm = self._lm
        return twin.to(self.device).eval()

    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """g for the pairs (features[:, j], next_ids[:, j]) at `positions` [rows, n], attending
        to the pairs already in `cache` and causally among these, or as `mask` says
        ([n, cached + n], True where a query sees a key: `_unrolled_mask`)."""
        with torch.no_grad():
            embedded = self._embed(next_ids).float()
        hidden = self.fc(torch.cat([embedded, features.float()], dim=-1))
        cos_sin = self._rotary(hidden, positions)
        if mask is None:
            seen = cache.get_seq_length() if cache is not None else 0
            keys = torch.arange(seen + positions.shape[1], device=hidden.device)
            queries = seen + torch.arange(positions.shape[1], device=hidden.device)
            mask = keys[None, :] <= queries[:, None]
        mask = mask[None, None].expand(positions.shape[0], 1, -1, -1)
        out = self.layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=cos_sin,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """Scores over `vocab_rows` (index into them for the token id)."""
        packed = self.__dict__.get("_lm_packed")
        return packed(g) if packed is not None else F.linear(g, self._lm)

    def pack(self) -> DraftHead:
        """For drafting on a CPU: the head's linears and its output rows as int8 weights for the
        streamed kernel (`pipeline.models.streamed`), a quarter of float32's bytes, since a step
        at batch 1 is bound by reading them. Drafts may change a little; outputs cannot, the
        target checks every draft. A packed head no longer trains or saves. Elsewhere (a GPU,
        no kernel): as it is."""
        from pipeline.models import streamed

        if self.device.type != "cpu" or streamed.library() is None or "_lm_packed" in self.__dict__:
            return self
        streamed.stream_linears(self, int8=True)
        rows = torch.nn.Linear(self._lm.shape[1], self._lm.shape[0], bias=False)
        rows.weight = torch.nn.Parameter(self._lm, requires_grad=False)
        self.__dict__["_lm_packed"] = streamed.StreamedLinear(rows, int8=True)
        return self

    def save(self, directory: str | Path, steps: int | None = None) -> Path:
        """The head's weights and its config (with `steps`, the training steps it has had,
        where known: a re-run goes on from the most trained head)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, directory / HEAD_FILE)
        meta = {
            "format": HEAD_FORMAT,
            "fingerprint": self.fingerprint,
            "layer_class": self.layer.__class__.__name__,
            "vocab_rows": self.vocab_rows.tolist(),
            **({"steps": steps} if steps is not None else {}),
        }
        (directory / HEAD_CONFIG).write_text(json.dumps(meta) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: PreTrainedModel) -> DraftHead:
        """A saved head, bound to `target` (HeadError if it was trained on another)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            meta = json.loads((directory / HEAD_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise HeadError(f"{directory}: not a draft head ({HEAD_CONFIG} unreadable: {exc})") from None
        if meta.get("format") != HEAD_FORMAT:
            found = meta.get("format")
            raise HeadError(f"{directory}: head format {found}, this version reads {HEAD_FORMAT}")
        last = target.base_model.layers[-1]
        head = cls(target.config, type(last), torch.tensor(meta["vocab_rows"]), meta["fingerprint"])
        head.load_state_dict(load_file(directory / HEAD_FILE))
        head.steps_before = int(meta.get("steps", 0))
        return head.to(torch.float32).bind(target)


class HeadCache:
    """The head's keys and values for one row, as its decoder layer writes them (`update`, the
    one call `transformers`' attention makes), cut back to a length by `crop_to`."""

    def __init__(self):
        self.keys: torch.Tensor | None = None  # [1, kv heads, length, dim]
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self, *args) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop_to(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _vocab_rows(target: PreTrainedModel, vocab: int | None, rows: Sequence[int]) -> torch.Tensor:
    """Ids below `vocab` (0: every id; None: none) and `rows`, sorted."""
    size = target.get_output_embeddings().out_features
    low = range(0) if vocab is None else range(min(vocab, size) if vocab else size)
    return torch.tensor(sorted(set(low).union(r for r in rows if 0 <= r < size)), dtype=torch.long)


@torch.no_grad()
def step_seconds(target: PreTrainedModel, vocab: int, context: int, runs: int = 3) -> dict:
    """What a head of `target`'s shape costs per drafted token, after `context` pairs: the
    median of `runs` (5-draft chain − 1-draft chain) / 4, so one layer's step and the output
    layer over `vocab` rows, packed as a job packs it (`DraftHead.pack`). Its weights do not
    change the cost: a fresh head is timed."""
    last = target.base_model.layers[-1]
    head = DraftHead(target.config, type(last), _vocab_rows(target, vocab, ()), target_fingerprint(target))
    parameters = sum(p.numel() for p in head.parameters())
    head.bind(target).eval().pack()  # as a job drafts with it
    chain = HeadChain(head)
    hidden = target.config.hidden_size
    tokens = torch.randint(3, len(head.vocab_rows), (context + 1,)).tolist()
    chain.feed(torch.randn(context, hidden, device=head.device), tokens)
    timed = {}
    for drafts in (1, 5):
        chain.draft(drafts)  # warm-up
        samples = []
        for _ in range(runs):
            began = time.perf_counter()
            chain.draft(drafts)
            if head.device.type == "cuda":
                torch.cuda.synchronize(head.device)
            samples.append(time.perf_counter() - began)
        timed[drafts] = sorted(samples)[len(samples) // 2]
    return {
        "step_seconds": max(timed[5] - timed[1], 0.0) / 4,
        "first_draft_seconds": timed[1],
        "parameters": parameters,
        "vocab_rows": len(head.vocab_rows),
        "context": context,
        "packed": "_lm_packed" in head.__dict__,
    }


@torch.no_grad()
def target_features(target: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """The target's last hidden states (after the final norm) at every position of `ids`, [T, H]."""
    device = target.get_input_embeddings().weight.device
    out = target.base_model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    return out.last_hidden_state[0].float()


# --------------------------------------------------------------------------------------------
# drafting: one row's chain, the head's cache kept at the accepted sequence


class HeadChain:
    """The head following one row: its cache holds the pairs (f_i, x_{i+1}) of the accepted
    sequence, with the target's true features; `draft` runs γ steps past it and rolls back."""

    def __init__(self, head: DraftHead, start: int = 0, record: bool = False):
        self.head = head
        self.record = record
        self.restart(start)

    def restart(self, start: int) -> None:
        """Follow the row from pair `start` on, with nothing before it (a prompt whose start the
        target reused from an earlier one, and so computed no features for)."""
        self.cache = HeadCache()
        self.start = self.fed = start  # pairs in the cache: i = start .. fed-1
        self.last: torch.Tensor | None = None  # g at pair fed-1
        self._drafts: list[int] = []  # drafted since `fed` (`step`), until `rollback`
        self._g: torch.Tensor | None = None  # g after the last of them
        # features of the pairs from `fed` on, kept until a draft needs them (`defer`)
        self._waiting: list[torch.Tensor] = []
        self.fresh = 0  # of those, the pairs the last verify pass computed (`defer(fresh=True)`)
        self._seq: Sequence[int] = ()
        # with `record`: every feature the chain was given, pairs start .. known-1 (`document`)
        self.recorded: list[torch.Tensor] = []

    @property
    def waiting(self) -> int:
        """Pairs whose features are kept to feed (`defer`)."""
        return sum(len(f) for f in self._waiting)

    @property
    def known(self) -> int:
        """Pairs whose features the chain holds: fed, or kept to feed (`defer`)."""
        return self.fed + self.waiting

    def defer(self, features: torch.Tensor, seq: Sequence[int], fresh: bool = False) -> None:
        """As `feed` (features[i] is the target's feature at position `known` + i), but kept
        until the next draft: a head that is not asked to draft costs nothing, and when it is,
        the pairs go through its layer in one pass. `fresh`: the features of the round just
        verified (those of a prompt, or kept over rounds that did not draft, are not)."""
        n = min(len(seq) - 1 - self.known, features.shape[0])
        self.fresh = max(n, 0) if fresh else 0
        if n > 0:
            self._waiting.append(features[:n])
            if self.record:
                self.recorded.append(features[:n].to(torch.bfloat16))
        self._seq = seq

    def document(self, prompt_len: int) -> Document | None:
        """The row as a training document (`OnlineHead`): prompt, the target's completion, and
        the features recorded since `start` (the pairs before it, a reused prompt start the
        target computed none for, left out). None without a completion to learn from."""
        seq = list(self._seq)
        if not self.record or prompt_len <= self.start or len(seq) - prompt_len < 2:
            return None
        features = torch.cat(self.recorded) if self.recorded else torch.empty(0)
        if len(features) < len(seq) - 1 - self.start:
            return None
        return Document(seq[self.start : prompt_len], seq[prompt_len:], features)

    def flush(self) -> None:
        """Feed the pairs `defer` kept."""
        if self._waiting:
            waiting, self._waiting, self.fresh = torch.cat(self._waiting), [], 0
            self.feed(waiting, self._seq)

    @torch.no_grad()
    def feed(self, features: torch.Tensor, seq: Sequence[int]) -> None:
        """Feed the pairs from `fed` up to the last whose next token is known: features[i] is
        the target's feature at position i (for i >= fed), `seq` the accepted tokens."""
        stop = min(len(seq) - 1, self.fed + features.shape[0])
        if stop <= self.fed:
            return
        n = stop - self.fed
        ids = torch.tensor([list(seq[self.fed + 1 : stop + 1])], device=self.head.device)
        positions = torch.arange(self.fed, stop, device=self.head.device)[None]
        g = self.head(features[None, :n].to(self.head.device), ids, positions, self.cache)
        self.fed, self.last = stop, g[0, -1]

    @torch.no_grad()
    def step(self) -> tuple[int, float]:
        """One more draft past the accepted sequence and those drafted since `fed`: the token
        and the head's confidence in it (its largest probability over `vocab_rows`). The
        drafted pairs stay in the cache until `rollback`."""
        self.flush()
        if self._drafts:  # the pair (g, last draft) goes in first, at the position after fed-1
            ids = torch.tensor([[self._drafts[-1]]], device=self.head.device)
            at = self.fed + len(self._drafts) - 1
            positions = torch.tensor([[at]], device=self.head.device)
            self._g = self.head(self._g[None, None], ids, positions, self.cache)[0, -1]
        elif self._g is None:
            self._g = self.last
        probs = torch.softmax(self.head.logits(self._g).float(), dim=-1)
        sure, index = probs.max(dim=-1)
        token = int(self.head.vocab_rows[int(index)])
        self._drafts.append(token)
        return token, float(sure)

    def rollback(self) -> None:
        """Back to the accepted sequence's `fed` pairs: the drafted pairs leave the cache."""
        self.cache.crop_to(self.fed - self.start)
        self._drafts, self._g = [], None

    def draft(self, gamma: int) -> list[int]:
        """γ greedy tokens after the accepted sequence; the cache is back at `fed` pairs after."""
        if self.last is None or gamma < 1:
            return []
        tokens = [self.step()[0] for _ in range(gamma)]
        self.rollback()
        return tokens


@dataclass
class ChainFigures:
    """Greedy speculation with the head against the target's own completions, round by round."""

    rounds: int = 0
    tokens: int = 0  # produced: accepted drafts plus the target's own token, per round
    drafted: int = 0
    accepted: int = 0
    by_position: list[int] = field(default_factory=list)  # rounds whose k-th draft was accepted

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def first(self) -> float:
        """Acceptance of the first draft (the head's α at position 1)."""
        return self.by_position[0] / self.rounds if self.rounds and self.by_position else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tau": round(self.tau, 3), "first_position": round(self.first, 3)}


def replay(
    head: DraftHead,
    prompt: Sequence[int],
    completion: Sequence[int],
    features: torch.Tensor,
    gamma: int,
    figures: ChainFigures | None = None,
) -> ChainFigures:
    """The rounds greedy speculation with the head would make over one document whose target
    output is `completion` (greedy: a draft is accepted while it equals the target's token),
    `features` the target's over prompt + completion. Exactly the engine's rounds at batch 1,
    without the target's passes: those are known already. A round's drafts after its first
    miss cannot change what it accepts, so they are counted as drafted but not computed (an
    untrained head's replay at γ 8 took 8 head steps a round for one's worth of figures)."""
    figures = figures or ChainFigures()
    seq = list(prompt) + list(completion)
    chain = HeadChain(head)
    accepted = len(prompt) + 1  # the prefill's pass chose the first completion token
    chain.feed(features, seq[:accepted])
    while accepted < len(seq):
        want = min(gamma, len(seq) - accepted) if chain.last is not None else 0
        hits = 0
        while hits < want and chain.step()[0] == seq[accepted + hits]:
            hits += 1
        chain.rollback()
        figures.rounds += 1
        figures.drafted += want
        figures.accepted += hits
        produced = min(hits + 1, len(seq) - accepted)
        figures.tokens += produced
        if len(figures.by_position) < gamma:
            figures.by_position += [0] * (gamma - len(figures.by_position))
        for k in range(hits):
            figures.by_position[k] += 1
        accepted += produced
        chain.feed(features[chain.fed :], seq[:accepted])
    return figures


# --------------------------------------------------------------------------------------------
# training


@dataclass
class HeadTraining:
    """How a head's training went: what bounded it and the loss of every step."""

    lr: float = 1e-3
    epochs: float = 0.0
    steps: int = 0
    seconds: float = 0.0
    stopped_by: str = ""
    tokens: int = 0  # completion tokens per epoch
    dtype: str = "float32"  # the products' (`training_dtype`)
    chained_steps: int = 1  # draft steps learned at every pair (`head_loss`)
    loss: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Document:
    """A prompt, the target's completion of it, and the target's features over both."""

    prompt: list[int]
    completion: list[int]
    features: torch.Tensor  # [len(prompt) + len(completion), H]
    # the target's own greedy choice after every position (its output layer over `features`):
    # labels for the prompt's positions too, where the text is not the target's
    choices: torch.Tensor | None = None


def documents(
    target: PreTrainedModel, pairs: Sequence[tuple[list[int], list[int]]], choices: bool = False
) -> list[Document]:
    """Each (prompt, completion) with the target's features: one forward pass per document;
    with `choices`, the target's greedy choice at every position too."""
    return [document(target, p, c, choices) for p, c in pairs]


def document(
    target: PreTrainedModel,
    prompt: Sequence[int],
    completion: Sequence[int],
    choices: bool = False,
    features: torch.Tensor | None = None,
) -> Document:
    """One `documents` entry; `features` given (kept from an earlier computation) spare the
    target's pass, the choices, where asked, still read through its output layer."""
    if features is None:
        features = target_features(target, list(prompt) + list(completion))
    picked = _choices(target, features) if choices else None
    return Document(list(prompt), list(completion), features, picked)


@torch.no_grad()
def _choices(target: PreTrainedModel, features: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    layer = target.get_output_embeddings()
    # the target's own (bfloat16 when its features were computed so); a kernel's layer
    # (`StreamedLinear`, `BlockLinear`) holds no `weight` and reads float32 rows
    weight = getattr(layer, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    parts = [layer(features[i : i + chunk].to(dtype)).argmax(-1) for i in range(0, len(features), chunk)]
    return torch.cat(parts)


def _teacher_forced(
    head: DraftHead, doc: Document, steps: int = 1
) -> tuple[list[torch.Tensor], torch.Tensor, int, list[int]]:
    """g_i from (f_i, x_{i+1}) at the pairs `head_loss` learns, their labels (the completion's
    x_{i+2}, or with the target's `choices`, its choice after every position i+1), the first
    such pair's i, and the first pair of each step's g.

    With `steps` k > 1, also the head's k-th chained step (training-time test, as EAGLE-3
    trains): step k at pair i reads the head's own step k-1 output at i-1 in place of f_i,
    beside the true token x_{i+1}, and attends as a chain does after k-1 drafts: to the true
    pairs up to i-k+1 and to the chained pairs i-k+2 .. i of steps 2 .. k (`_unrolled_mask`).
    Its label is the same x_{i+2}: a k-th draft counts only where the drafts before it were the
    true tokens. Pairs i < k-1 have no such chain (label ignored). A job drafts only in its
    outputs, so the chained steps run at the completion's pairs (step k from k-`steps` pairs
    before its first, where the later steps read it), not the prompt's: with the prompts'
    positions learned too (`choices`), chaining there too cost most of a document's products
    for drafts no job makes (docs/choosing-a-draft.md, measured).
    One g per step, [pairs learned from that step's first on, H]."""
    seq = doc.prompt + doc.completion
    n = len(seq) - 1  # pairs i = 0 .. n-1
    completion = max(len(doc.prompt) - 1, 0)  # pair i predicts x_{i+2}: the completion's from here
    if doc.choices is not None:
        first, labels = 0, doc.choices[1:].to(head.device)
    else:
        first, labels = completion, torch.tensor(seq[completion + 2 :], device=head.device)
    end = first + len(labels)
    # the pairs each step computes from: all for step 1 (the true pairs every chain attends to)
    begins = [0] + [min(max(completion - steps + k, 0), n) for k in range(2, steps + 1)]
    ids = torch.tensor([seq[1:]], device=head.device)
    positions = torch.arange(n, device=head.device)[None]
    cache = HeadCache() if steps > 1 else None
    computed = [head(doc.features[None, :n].to(head.device), ids, positions, cache)[0]]  # [n, H]
    for k in range(2, steps + 1):
        begin, before = begins[k - 1], begins[k - 2]
        if begin >= n:  # no completion to chain over (a document of its prompt alone)
            break
        back = torch.arange(begin - 1, n - 1, device=head.device) - before  # step k-1's g at i-1
        fed = computed[-1][back.clamp(min=0)] * (back >= 0)[:, None]
        mask = _unrolled_mask(n, k, head.device, begins)
        computed.append(head(fed[None], ids[:, begin:], positions[:, begin:], cache, mask=mask)[0])
    starts = [max(b, first) for b in begins]
    return [g[s - b : end - b] for g, s, b in zip(computed, starts, begins)], labels, first, starts


def _unrolled_mask(n: int, k: int, device, begins: Sequence[int] | None = None) -> torch.Tensor:
    """Which keys step k's query at pair i (i from `begins[k-1]` on) sees, over the keys of steps
    1 .. k in the cache (step m's at pairs `begins[m-1]` .. n-1, in that order): step 1's at
    pairs <= i-k+1, and step m's (2 <= m <= k) at pair i-k+m alone, as a chain at pair i that
    drafted k-1 tokens past the true ones holds. `begins` None: every step at every pair."""
    begins = list(begins) if begins is not None else [0] * k
    queries = torch.arange(begins[k - 1], n, device=device)[:, None]
    blocks = [torch.arange(n, device=device)[None, :] <= queries - k + 1]
    blocks += [
        torch.arange(begins[m - 1], n, device=device)[None, :] == queries - k + m for m in range(2, k + 1)
    ]
    return torch.cat(blocks, dim=1)


class Calibration:
    """What a head's confidence is worth: of the drafts it made at about that confidence, how
    many the target accepted for each one the confidences promised, band by band.

    A head trained on a few thousand tokens ranks its drafts far better than it prices them:
    right a few times in ten where it is least sure and most times where it is surest, while
    its confidence says nearly 1 for half of them (measured in docs/choosing-a-draft.md). One
    ratio for every draft prices the surest as low as the rest, and where a verify token costs
    a third of a pass (a CPU) lets few of them through. So each band keeps its own ratio of
    accepted over promised (recent drafts weighing most), and a band few drafts fell in leans on
    the ratio over all bands (`overall`, from `prior` until drafts say otherwise): a head that
    proved over-confident where it drafted is not taken at its word where it has not yet."""

    EDGES = (0.25, 0.5, 0.75, 0.9, 0.97, 0.99, 0.999)  # the bands' upper ends; the last runs to 1
    WEIGHT = 4.0  # drafts' worth of confidence the ratio over all counts for in a band

    def __init__(self, prior: float = 1.0, hits: Sequence[float] = (), promised: Sequence[float] = ()):
        self.overall = RunningRate(prior=min(prior, 4.0), weight=self.WEIGHT, cap=4.0)
        self.bands = [RunningRate(prior=0.0, weight=0.0, cap=4.0) for _ in range(len(self.EDGES) + 1)]
        for band, accepted, drafted in zip(self.bands, hits, promised):
            band.update(accepted, drafted)
        self.overall.update(sum(hits), sum(promised))

    @classmethod
    def measured(cls, checks: Sequence[FirstDrafts]) -> Calibration:
        """From the first drafts at every position of some documents (`first_draft_hits`)."""
        hits = [sum(band) for band in zip(*(c.hits_by_band for c in checks))]
        promised = [sum(band) for band in zip(*(c.promised_by_band for c in checks))]
        overall = sum(promised)
        return cls(sum(hits) / overall if overall > 0 else 1.0, hits, promised)

    def _band(self, chance: float) -> RunningRate:
        return self.bands[bisect.bisect_left(self.EDGES, chance)]

    def ratio(self, chance: float) -> float:
        """Drafts accepted per one promised, for drafts about `chance` sure."""
        band = self._band(chance)
        return min((band.accepted + self.overall.value * self.WEIGHT) / (band.drafted + self.WEIGHT), 4.0)

    def __call__(self, chance: float) -> float:
        """The chance the target accepts drafts the head was `chance` sure of."""
        return chance * self.ratio(chance)

    def observe(self, chance: float, accepted: bool) -> None:
        self._band(chance).update(float(accepted), chance)
        self.overall.update(float(accepted), chance)

    @property
    def promised(self) -> float:
        """Confidence the drafts observed promised (decayed), over every band."""
        return sum(band.drafted for band in self.bands)


class FirstDrafts(NamedTuple):
    """A head's first drafts over a document's completion (`first_draft_hits`), by band of
    confidence (`Calibration.EDGES`): what the next copy drafts with, and, summed, the shard
    stats' accuracy and confidence."""

    tokens: int  # drafts made
    hits_by_band: tuple[int, ...]  # drafts equal to the target's token
    promised_by_band: tuple[float, ...]  # the head's confidences in them, summed

    @property
    def hits(self) -> int:
        return sum(self.hits_by_band)

    @property
    def promised(self) -> float:
        """What the head's confidences said it would get right."""
        return sum(self.promised_by_band)


@torch.no_grad()
def first_draft_hits(head: DraftHead, doc: Document) -> FirstDrafts:
    """How many of the completion's tokens (after the first, which the prefill chooses) the head
    drafts first given the target's features up to them, of how many, and how sure it was: a
    round's first draft sees exactly this (the chain holds the accepted pairs' true features),
    so it is the head's first-position acceptance over every position rather than at the
    rounds' starts, in one pass over the document instead of a replay."""
    (predicted,), labels, _, _ = _teacher_forced(head, replace(doc, choices=None))
    sure, index = torch.softmax(head.logits(predicted).float(), dim=-1).max(dim=-1)
    right = (head.vocab_rows[index] == labels).float()
    bands = torch.bucketize(sure, torch.tensor(Calibration.EDGES, device=sure.device))
    by_band = torch.zeros(2, len(Calibration.EDGES) + 1, device=sure.device)
    by_band[0].index_add_(0, bands, right)
    by_band[1].index_add_(0, bands, sure)
    return FirstDrafts(len(labels), tuple(int(h) for h in by_band[0].tolist()), tuple(by_band[1].tolist()))


def head_loss(head: DraftHead, doc: Document, regression: float = 1.0, steps: int = 1) -> torch.Tensor | None:
    """Teacher forcing over one document (`_teacher_forced`, `steps` chained steps): each
    step's cross-entropy of each pair's label, and smooth L1 of its g_i against f_{i+1}.
    None where the document has no pair to learn (a completion of a token or two)."""
    chained, labels, first, starts = _teacher_forced(head, doc, steps)
    index = _label_index(head, labels)
    target = doc.features[first + 1 : first + 1 + len(labels)].to(head.device, torch.float32)
    loss = 0.0
    for k, (predicted, start) in enumerate(zip(chained, starts), start=1):
        pairs = torch.arange(start, start + len(predicted), device=index.device)
        # step k has no chain before pair k-1
        at = torch.where(pairs >= k - 1, index[start - first :], -100)
        if not bool((at != -100).any()):  # a short document: nothing for this step to learn
            continue
        loss = loss + F.cross_entropy(head.logits(predicted), at, ignore_index=-100)
        if regression:
            chain = max(k - 1 - start, 0)
            loss = loss + regression * F.smooth_l1_loss(predicted[chain:], target[start - first :][chain:])
    return loss if isinstance(loss, torch.Tensor) else None


def _label_index(head: DraftHead, labels: torch.Tensor) -> torch.Tensor:
    """Token ids as indices into `vocab_rows` (-100 for a token the head cannot propose)."""
    rows = head.vocab_rows.to(labels.device)
    at = torch.searchsorted(rows, labels).clamp(max=len(rows) - 1)
    return torch.where(rows[at] == labels, at, torch.full_like(at, -100))


def train(
    head: DraftHead,
    docs: Sequence[Document],
    *,
    lr: float = 1e-3,
    epochs: float = 2.0,
    max_seconds: float | None = None,
    seed: int = 0,
    steps: int = CHAINED_STEPS,
    on_step: Callable[[int, float], None] | None = None,
) -> HeadTraining:
    """AdamW over the head's `fc` and layer, one document per step, until `epochs` or
    `max_seconds`, each document teaching `steps` chained draft steps (`head_loss`)."""
    record = HeadTraining(lr=lr, tokens=sum(len(d.completion) for d in docs), chained_steps=steps)
    if not docs:
        return record
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    dtype = training_dtype(head.device)
    record.dtype = str(dtype).removeprefix("torch.")
    total = max(1, math.ceil(epochs * len(docs)))
    warm_then_decay = lambda s: min(1.0, (s + 1) / 20) * (1 - s / (total + 1))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warm_then_decay)
    order: list[int] = []
    rng = random.Random(seed)
    began = time.perf_counter()
    head.train()
    record.stopped_by = "epochs"
    for step in range(total):
        if max_seconds is not None and time.perf_counter() - began > max_seconds:
            record.stopped_by = "max_seconds"
            break
        if not order:
            order = list(range(len(docs)))
            rng.shuffle(order)
        loss = _learn(head, optimizer, params, docs[order.pop()], dtype, steps)
        if loss is None:
            continue
        record.loss.append(loss)
        schedule.step()
        record.steps += 1
        if on_step:
            on_step(step, loss)
    head.eval()
    record.epochs = round(record.steps / len(docs), 3)
    record.seconds = round(time.perf_counter() - began, 2)
    return record


def _tokens(doc: Document) -> int:
    return len(doc.prompt) + len(doc.completion)


def training_dtype(device: torch.device) -> torch.dtype:
    """What a head's training computes its products in: bfloat16 where the device multiplies
    it fast (a GPU, or a CPU with AVX512-BF16 or AMX: 2.5x float32's speed for a step of the
    1.5B's head on 2 AVX-512 cores), as autocast, the weights and the optimizer's state staying
    float32; float32 elsewhere (emulated bf16 would be slower)."""
    from pipeline.models.loading import resolve_dtype

    dtype = resolve_dtype("auto", device.type)
    return dtype if dtype == torch.bfloat16 else torch.float32


def _learn(
    head: DraftHead, optimizer, params, doc: Document, dtype: torch.dtype, steps: int = CHAINED_STEPS
) -> float | None:
    """One training step on one document, products in `dtype`, `steps` chained draft steps; its
    loss, or None (and no step) where the document had nothing to learn or the loss overflowed."""
    with torch.autocast(head.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = head_loss(head, doc, steps=steps)
    if loss is None or not bool(torch.isfinite(loss)):  # nothing to learn here: no step
        return None
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    return round(loss.item(), 4)


class OnlineHead:
    """A head that goes on learning while its job runs (`drafter.head_online`).

    Every row the engine decodes with the head is a labelled example of the target on the job's
    own corpus: the prompt, the target's completion, and the target's features at every
    position, which its passes computed anyway (the head's chains record them, `HeadChain
    .document`): no extra pass. Between shards (`refine`) the head trains on them, each new
    document once, newest first, then older ones, for `share` times the seconds the documents
    took to decode; the engine then drafts with a packed copy (`drafting`) while this float32
    one keeps its optimizer's state for the next shard.

    Before learning from them, the drafting copy's first draft is checked on every new
    document (`first_draft_hits`): its first-position acceptance on rows it had not learned
    from, the same whatever the policy let it draft, so that shard after shard the stats show
    what the job taught it. The same check says how far its confidences overstate (or
    understate) its hits: `calibration`, which the next copy drafts with from its first round.
    The engine's own rounds measure that only on the drafts the policy let through, and a
    head calibrated afresh each shard overstates itself until enough drafts were rejected.

    Why: a head distilled offline knows its training texts better than the job's (figures in
    docs/choosing-a-draft.md); a nightly job's corpus has its own terms and phrasing, and a job
    that starts with no head at all can grow one."""

    KEEP_TOKENS = 1 << 16  # documents kept to learn from, newest first (bf16 features: 2·H bytes a token)
    LR = 1e-3
    WARM_STEPS = 20
    # a refinement has a few seconds: the first draft, learned alone, improves fastest in them
    # (chained steps cost a pass each and pay only once the first draft is often right)
    CHAINED_STEPS = 1

    def __init__(self, head: DraftHead, share: float):
        if "_lm_packed" in head.__dict__:
            raise HeadError("a packed head cannot learn: give OnlineHead the head as loaded")
        self.head = head
        self.share = share
        self.drafting = head.snapshot().pack()
        self.dtype = training_dtype(head.device)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.LR, weight_decay=0.0)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / self.WARM_STEPS)
        )
        self.kept: deque[Document] = deque()
        self.fresh = 0  # the newest documents in `kept` not trained on yet
        self.decode_seconds = 0.0  # decoding with the head since the last refinement
        self.owed = 0.0  # seconds the last refinement ran past its budget (its last step)
        self.steps = 0
        self.calibration = Calibration()  # the drafting copy's hits per one its confidences promise

    def add(self, docs: Sequence[Document], seconds: float) -> None:
        """Documents the engine just decoded with the head, in `seconds`."""
        self.kept.extend(docs)
        self.fresh = min(self.fresh + len(docs), len(self.kept))
        self.decode_seconds += seconds
        tokens = sum(map(_tokens, self.kept))
        while len(self.kept) > 1 and tokens > self.KEEP_TOKENS:
            tokens -= _tokens(self.kept.popleft())
            self.fresh = min(self.fresh, len(self.kept))

    def refine(self) -> dict | None:
        """Train within the budget (see the class); what it did, or None with nothing new.
        A step that starts within the budget finishes: what it ran past comes off the next."""
        if not self.fresh:
            return None
        budget = self.share * self.decode_seconds - self.owed
        docs = list(self.kept)
        new, old = docs[len(docs) - self.fresh :][::-1], docs[: len(docs) - self.fresh]
        random.Random(self.steps).shuffle(old)
        began = time.perf_counter()
        checks = [first_draft_hits(self.drafting, doc) for doc in new]
        hits, tokens = sum(c.hits for c in checks), sum(c.tokens for c in checks)
        promised = sum(c.promised for c in checks)
        if promised > 0:
            self.calibration = Calibration.measured(checks)
        check_seconds = time.perf_counter() - began
        began = time.perf_counter()
        losses: list[float] = []
        self.head.train()
        for doc in new + old:
            if time.perf_counter() - began >= budget:
                break
            loss = _learn(self.head, self.optimizer, self.params, doc, self.dtype, self.CHAINED_STEPS)
            if loss is not None:
                losses.append(loss)
                self.schedule.step()
        self.head.eval()
        seconds = time.perf_counter() - began
        self.drafting = self.head.snapshot().pack()
        record = {
            "first_draft": {  # the new rows, before the head learns from them
                "accuracy": round(hits / max(tokens, 1), 4),
                "confidence": round(promised / max(tokens, 1), 4),
                "tokens": tokens,
                "seconds": round(check_seconds, 3),
            },
            "documents_new": self.fresh,
            "documents_kept": len(docs),
            "tokens_kept": sum(map(_tokens, docs)),
            "steps": len(losses),
            "seconds": round(seconds, 3),
            "budget_seconds": round(max(budget, 0.0), 3),
            "loss_mean": round(sum(losses) / len(losses), 4) if losses else None,
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        self.steps += len(losses)
        self.owed = max(seconds - budget, 0.0)  # a debt the budget did not cover carries on
        self.fresh = 0  # those the budget left untrained join the older ones
        self.decode_seconds = 0.0
        return record


# --------------------------------------------------------------------------------------------
# the engine's drafter


# How a round's head drafts end (see `Policy.head_length`): after each step, given each row's
# chance that all its drafts so far are accepted and how many it has, whether the row keeps its
# newest draft and whether it drafts one more.
HeadRule = Callable[[list[float], list[int]], list[tuple[bool, bool]]]


class HeadDrafter:
    """The head as one of the engine's drafters (`Drafter`): a chain per row, fed the target's
    features of every pass (`lm.features`, kept while this drafter follows the rows) once the
    round's accepted tokens are known (`follow`), drafting greedily. A greedy draft is a point
    mass, so the target's check keeps sampled decoding exact as well.

    The rows draft in step (one head step for every row still going), each step's draft kept
    while the chance that the row's drafts are all accepted pays for its verify token (`rule`,
    from the policy). That chance is the product of the head's confidences, scaled by
    `calibration`: how many drafts the target accepted for each one the confidences promised,
    by band of confidence, measured on this drafter's own rounds (the confidences of a head
    trained on a few thousand tokens need not be calibrated, `Calibration`)."""

    name = HEAD

    def __init__(self, head: DraftHead, lm):
        self.lm = lm  # the target's runner (`BatchedLM`), whose passes leave their features
        self.chains: list[HeadChain | None] = []
        self.seconds = 0.0  # spent drafting and feeding, for the engine's stats
        # of those, spent feeding the pairs of prompts and of rounds that did not draft, since
        # the engine last took them (`take_catch_up`)
        self.catch_up_seconds = 0.0
        self.step_seconds: float | None = None  # one step of every going row, lately
        self._proposed: list[tuple[int, list[int], list[float]]] = []  # per row: length, drafts, chances
        self.replace(head)
        self._token_seconds: float | None = None
        self._round_seconds = 0.0
        # with `learning` (an `OnlineHead` refines the head between shards): each finished
        # row as a training document, until the learner takes them
        self.learning = False
        self.finished: list[Document] = []
        self._prompt_lens: list[int] = []

    REST_ROUNDS = 16  # rounds a head that does not pay rests at first (doubling while it does not)
    JUDGE_ROUNDS = 8  # rounds of drafting before the head is judged

    def start(self, prompts: list[list[int]]) -> None:
        self.lm.keep_features = True
        self.chains = []
        self._prompt_lens = []
        self._proposed = []
        self.admit(prompts)

    def admit(self, prompts: list[list[int]]) -> None:
        """New rows, just prefilled: their chains start from the prefill's features."""
        if not prompts:
            return
        began = time.perf_counter()
        for seq, (start, features) in zip(prompts, self.lm.features):
            chain = HeadChain(self.head, start, record=self.learning)
            chain.defer(features, seq)
            self.chains.append(chain)
            self._prompt_lens.append(len(seq) - 1)  # an admitted row holds the prefill's token
        self.seconds += time.perf_counter() - began

    def follow(self, seqs: list[list[int]]) -> None:
        """The round's verify pass is in and each row's accepted sequence is `seqs`: learn how
        the drafts fared against their chances, then feed the pairs whose features the pass
        computed after accepted tokens."""
        began = time.perf_counter()
        worth = 0
        for (length, drafts, chances), seq in zip(self._proposed, seqs):
            got = seq[length : length + len(drafts)]
            hits = next((k for k, (t, d) in enumerate(zip(got, drafts)) if t != d), len(got))
            for k, chance in enumerate(chances):  # drafts 1..k+1 all accepted, at that chance
                self.calibration.observe(chance, k < hits)
            worth += hits
        if self._proposed:
            self._judge(worth)
        self._proposed = []
        for chain, seq, (start, features) in zip(self.chains, seqs, self.lm.features):
            if chain.known < start:  # features missing (a row the head was not following): restart
                chain.restart(start)
            chain.defer(features[chain.known - start :], seq, fresh=True)
        self.seconds += time.perf_counter() - began

    def take_catch_up(self) -> float:
        """Seconds spent feeding pairs kept from before the last round since the last call: a
        prompt's (a one-off per row), or those of rounds the head did not draft in (resting,
        or rounds that asked no drafter), fed at its next draft. A cost of having followed the
        row at all, not of the round that pays it: the engine's gate and the head's own
        judgement compare rounds by their rate, and one round charged a prompt's feed turned
        `auto`'s drafting off for its copies too (docs/choosing-a-draft.md)."""
        seconds, self.catch_up_seconds = self.catch_up_seconds, 0.0
        return seconds

    def _judge(self, accepted: int) -> None:
        """After a round the head drafted in: did its accepted drafts, at what a token is worth
        lately, pay for its seconds? Judged over the last rounds (their sums decaying), once
        `JUDGE_ROUNDS` have passed; a head that did not pay rests (drafts nothing, and its
        chains only keep the target's features, which costs nothing) for `REST_ROUNDS`, twice
        as many after each judgement it fails again, then drafts again to be judged anew."""
        if self._token_seconds is None:
            return
        self._worth = 0.9 * self._worth + accepted * self._token_seconds
        self._cost = 0.9 * self._cost + self._round_seconds
        self._judged += 1
        if self._judged < self.JUDGE_ROUNDS:
            return
        if self._worth >= self._cost:
            self._rest_gap = self.REST_ROUNDS
            return
        self._rest, self._rest_gap = self._rest_gap, min(2 * self._rest_gap, 8 * self.REST_ROUNDS)
        self._worth = self._cost = 0.0
        self._judged = 0

    @property
    def resting(self) -> bool:
        return self._rest > 0

    def replace(self, head: DraftHead, calibration: Calibration | None = None) -> None:
        """Draft with `head` from the next batch on (a refined one, `OnlineHead`): judged
        afresh, so that a head which rested for want of skill drafts again, and calibrated from
        `calibration`, what the learner measured at every position of the rows just decoded
        (ratios learned on the old head's drafts alone, after the rule cut its doubtful ones,
        would keep the new one's from ever being sent, and so from ever being measured).
        None: its confidences taken at their word until its drafts say otherwise."""
        self.head = head
        self.calibration = copy.deepcopy(calibration) if calibration is not None else Calibration()
        # what the head's accepted drafts were worth against what its steps cost, lately (`_judge`)
        self._worth = self._cost = 0.0
        self._judged = 0  # rounds since the last judgement
        self._rest = 0  # rounds left without drafting
        self._rest_gap = self.REST_ROUNDS

    def propose(
        self, seqs, gamma, params, generator, keep=None, guess=None, rule: HeadRule | None = None,
        token_seconds: float | None = None,
    ):  # fmt: skip
        """Up to `gamma` drafts per row; with `rule`, each row's as many as pay (see the class);
        none while the head rests (`_judge`; `token_seconds`: what a token is worth lately)."""
        from pipeline.decode.drafters import Proposal

        if self._rest > 0:
            self._rest -= 1
            self._proposed = []
            return Proposal(tokens=[[] for _ in seqs], probs=[None] * len(seqs), depths=[0] * len(seqs))
        self._token_seconds = token_seconds
        began = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in self.chains]
        chances = [[] for _ in self.chains]  # per row: the confidences' product over drafts 1..k
        catch_up = 0.0
        if gamma > 0:
            waiting = sum(chain.waiting for chain in self.chains)
            stale = waiting - sum(chain.fresh for chain in self.chains)
            for chain in self.chains:
                chain.flush()
            if stale > 0:  # the pairs' share of one pass through the head's layer
                catch_up = (time.perf_counter() - began) * stale / waiting
                self.catch_up_seconds += catch_up
        going = [gamma > 0 and chain.last is not None for chain in self.chains]
        while any(going):
            stepped = time.perf_counter()
            for i, chain in enumerate(self.chains):
                if going[i]:
                    token, sure = chain.step()
                    drafts[i].append(token)
                    chances[i].append((chances[i][-1] if chances[i] else 1.0) * sure)
            self.step_seconds = ema(self.step_seconds, time.perf_counter() - stepped, 0.3)
            verdicts = None
            if rule is not None:
                now = [self._calibrated(c[-1]) if c else 0.0 for c in chances]
                verdicts = rule(now, [len(d) for d in drafts])
            for i in range(len(going)):
                if not going[i]:
                    continue
                kept, more = verdicts[i] if verdicts else (True, True)
                if not kept:
                    drafts[i].pop()
                    chances[i].pop()
                going[i] = kept and more and len(drafts[i]) < gamma
        for chain in self.chains:
            chain.rollback()
        self._proposed = [(len(seq), d, c) for seq, d, c in zip(seqs, drafts, chances)]
        self.seconds += time.perf_counter() - began
        self._round_seconds = time.perf_counter() - began - catch_up
        return Proposal(tokens=drafts, probs=[None] * len(drafts), depths=[0] * len(drafts))  # one kind

    def chances(self) -> list[list[float]]:
        """Per row of the last proposal: the calibrated chance that its drafts 1..k are all
        accepted, for each k (what `auto` weighs them by)."""
        return [[self._calibrated(c) for c in chances] for _, _, chances in self._proposed]

    def _calibrated(self, chance: float) -> float:
        return min(self.calibration(chance), 0.99)

    def sent(self, counts: list[int]) -> None:
        """How many of each row's drafts went to the target (`auto` may have chosen another
        drafter for a row, or cut the head's drafts): only those say how the head fares."""
        self._proposed = [(length, d[:n], c[:n]) for (length, d, c), n in zip(self._proposed, counts)]

    def evict(self, keep: list[int], finished: list[list[int]]) -> None:
        if self.learning:
            kept = set(keep)
            for k, (chain, prompt_len) in enumerate(zip(self.chains, self._prompt_lens)):
                doc = chain.document(prompt_len) if k not in kept else None
                if doc is not None:
                    self.finished.append(doc)
        self.chains = [self.chains[k] for k in keep]
        self._prompt_lens = [self._prompt_lens[k] for k in keep]
