"""Session recording for the OpenAI-compatible endpoint: token ids in, token ids out.

An agent written against the `openai` client sends text (a prompt, or chat messages
the server renders to text) and gets text back. Training needs the exact token ids the
policy saw and sampled, with the logprob and policy version of each sampled token.
Re-tokenizing the conversation at every turn loses that: `encode(decode(ids))` is not
`ids` in general (BPE merges across the turn boundary, special tokens, whitespace
clean-up), so the trained trajectory would differ from the generated one, and the
behaviour logprobs would belong to tokens that were never sampled. Peers' trackers
are full of such multi-turn bugs.

So a `Session` keeps every call's ids, and a new request whose text starts with the
text of the previous call's prompt + output continues that call's *ids*: its prompt is
the previous prompt ids + output ids + `encode(the remaining text)`. Only the new text
(a tool result, a user turn) is ever encoded. A request that does not extend the
previous call (the agent edited the history, or two calls ran at once) is encoded
whole and starts a new chain.

The previous output's text is tried two ways: decoded with its special tokens (a chat
template that writes the end-of-turn token itself, as Qwen's does), then as the client
got it, without them (a template that only concatenates contents). In the second case
the chain keeps the sampled ids, EOS included: the model continues from what it
generated.

A request with `n > 1` is a fork: its n choices are recorded as n calls, each starting
its own chain (its prompt holds the history's ids: nothing is re-encoded), so each is
its own Sample; the next request continues whichever choice its text starts with (any
call of the latest request may be extended, not only the last one).

`Session.samples()` turns a session into training `Sample`s: calls that chain merge
into one Sample whose output is everything after the first call's prompt; the policy's
tokens have loss mask 1, the text in between (tool results, user turns) mask 0,
logprob 0.0 and version -1.

`SessionStore` bounds memory. Sessions idle for longer than a TTL are dropped; beyond
`max_sessions` live ones a new session is refused (`SessionsFull`) rather than the
least recently used evicted: evicting would let anyone who can open sessions cheaply
throw away the calls of a running episode, and a store full of live sessions is a
config problem (more agents at once than `max_sessions`) that should be seen. Each
session's recorded bytes are bounded too: a call that would take a session past
`max_session_bytes` is refused before it is generated (`SessionTooLarge`), and only
that session's call fails.

Pure Python, no Ray: `tokenize`/`detokenize` are passed in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from areal_ray.types import Sample

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


@dataclass
class Call:
    """One completion: the ids the engine saw and what it sampled."""
    prompt_text: str  # the prompt as the request rendered it
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" | "length"
    extends: int | None = None  # index of the call whose prompt+output this prompt starts with
    n_resubmits: int = 0
    history_texts: list[str] = field(default_factory=list)  # what a next request may start with

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("history_texts")
        return d

    @property
    def nbytes(self) -> int:
        return record_bytes(self.prompt_text, len(self.prompt_ids), len(self.output_ids),
                            self.history_texts)


# What a recorded call costs, estimated from its payload: a character per byte, 8 bytes
# per token id, logprob and version (as packed arrays would hold them). Python's lists
# and objects take a few times more; the bound is on what grows with the agent's input.
ID_BYTES = 8


def record_bytes(prompt_text: str, n_prompt_ids: int, n_output_ids: int,
                 history_texts: list[str] = ()) -> int:
    return (len(prompt_text) + sum(len(t) for t in history_texts)
            + ID_BYTES * (n_prompt_ids + 3 * n_output_ids))


class SessionsFull(Exception):
    """No room for another session: every one held is live (used within the TTL)."""


class SessionTooLarge(Exception):
    """The call would take its session past the store's `max_session_bytes`."""


class Session:
    """The calls of one agent session, and how a new request's prompt ids continue them."""

    def __init__(self, sid: str, encode: Encode, decode: Decode, encode_rest: Encode | None = None):
        self.sid, self.encode, self.decode = sid, encode, decode
        self.encode_rest = encode_rest or encode  # text that follows recorded ids (service.encode_rest)
        self.calls: list[Call] = []
        self.last_turn: list[int] = []  # the calls of the latest request: what may be extended
        self.nbytes = 0  # of the recorded calls (record_bytes)
        self.defaults = None  # the session's own sampling defaults, when its opener set them

    def prompt_ids(self, text: str) -> tuple[list[int], int | None]:
        """The ids to generate from for prompt `text`, and the index of the call they
        extend (None: a new chain). Never re-encodes a recorded call's text."""
        for i in self.last_turn:
            last = self.calls[i]
            for history in last.history_texts:
                if text.startswith(history):
                    rest = text[len(history):]
                    return last.prompt_ids + last.output_ids + (self.encode_rest(rest) if rest else []), i
        return self.encode(text), None

    def prompt_ids_of_tokens(self, ids: list[int]) -> tuple[list[int], int | None]:
        """Token-in requests (a completions prompt given as ids): the chain is decided
        on the ids themselves."""
        for i in self.last_turn:
            history = self.calls[i].prompt_ids + self.calls[i].output_ids
            if len(ids) >= len(history) and ids[:len(history)] == history:
                return list(ids), i
        return list(ids), None

    def record(self, prompt_text: str, prompt_ids: list[int], extends: int | None,
               sample: Sample) -> Call:
        """Add the finished call (`sample`: what interruptible generation returned).
        It chains only if the call it extends is still of the latest request (a call
        that finished in between, from a concurrent request, breaks the chain)."""
        return self.record_turn(prompt_text, prompt_ids, extends, [sample])[0]

    def record_turn(self, prompt_text: str, prompt_ids: list[int], extends: int | None,
                    samples: list[Sample]) -> list[Call]:
        """Add one request's calls: its choices, samples of the same prompt ids. Several
        are a fork: each starts its own chain (see the module docstring)."""
        if extends not in self.last_turn or len(samples) > 1:
            extends = None
        calls = [self._call(prompt_text, prompt_ids, extends, s) for s in samples]
        first = len(self.calls)
        self.calls += calls
        self.nbytes += sum(c.nbytes for c in calls)
        self.last_turn = list(range(first, len(self.calls)))
        return calls

    def _call(self, prompt_text: str, prompt_ids: list[int], extends: int | None,
              sample: Sample) -> Call:
        out = list(sample.output_ids)
        full = prompt_text + self.decode(out, False)
        shown = prompt_text + self.decode(out, True)
        call = Call(prompt_text=prompt_text, prompt_ids=list(prompt_ids), output_ids=out,
                    logprobs=list(sample.logprobs), versions=list(sample.versions),
                    finish_reason=sample.stop_reason, extends=extends,
                    n_resubmits=sample.n_resubmits,
                    history_texts=[full] if full == shown else [full, shown])
        return call

    def chains(self) -> list[list[Call]]:
        """Calls grouped into chains: a call joins the chain it extends the last call
        of. In the order of their last calls, so the chain holding the session's last
        call is last (one request's calls extend one of the latest request's, so
        without forks this is the order of the calls)."""
        chains: list[list[Call]] = []
        tail_of: dict[int, int] = {}  # the index of a chain's last call -> the chain
        for i, c in enumerate(self.calls):
            k = tail_of.pop(c.extends, None) if c.extends is not None else None
            if k is None:
                chains.append([c])
                k = len(chains) - 1
            else:
                chains[k].append(c)
            tail_of[i] = k
        last = {k: i for i, k in tail_of.items()}
        return [chains[k] for k in sorted(range(len(chains)), key=last.__getitem__)]

    def samples(self) -> list[Sample]:
        return [chain_sample(chain, self.decode) for chain in self.chains()]

    def to_dict(self) -> dict:
        return {"id": self.sid, "calls": [c.to_dict() for c in self.calls],
                "samples": [asdict(s) for s in self.samples()]}


def chain_sample(chain: list[Call], decode: Decode | None = None) -> Sample:
    """One Sample of calls that chain: the first call's prompt, then each call's output
    (loss mask 1) and the tokens between it and the next call's output (mask 0,
    logprob 0.0, version -1)."""
    first = chain[0]
    out, logprobs, versions, mask = [], [], [], []
    pos = len(first.prompt_ids)  # where the next call's new prompt tokens start
    for c in chain:
        between = c.prompt_ids[pos:]
        out += between
        logprobs += [0.0] * len(between)
        versions += [-1] * len(between)
        mask += [0] * len(between)
        out += c.output_ids
        logprobs += c.logprobs
        versions += c.versions
        mask += [1] * len(c.output_ids)
        pos = len(c.prompt_ids) + len(c.output_ids)
    return Sample(prompt_ids=list(first.prompt_ids), output_ids=out, logprobs=logprobs,
                  versions=versions, stop_reason=chain[-1].finish_reason,
                  text=decode(out, True) if decode else "",
                  n_resubmits=sum(c.n_resubmits for c in chain), loss_mask=mask,
                  n_turns=len(chain), tool_calls=len(chain) - 1)


class SessionStore:
    """Sessions by id, bounded (see the module docstring): on every access, sessions
    idle for more than `ttl_s` are dropped; a new session beyond `max_sessions` live
    ones is refused; a session's calls are refused past `max_session_bytes`. A dropped
    session's calls are gone (an agent that comes back starts a new one), so the TTL
    must exceed the longest pause inside an episode."""

    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_session_bytes: int | None = None, on_drop: Callable[[str], None] | None = None):
        """`on_drop(sid)`: told of each session dropped after `ttl_s` idle."""
        if max_sessions < 1 or ttl_s <= 0 or (max_session_bytes is not None and max_session_bytes < 1):
            raise ValueError(f"max_sessions ({max_sessions}) must be >= 1, ttl_s ({ttl_s}) > 0 and "
                             f"max_session_bytes ({max_session_bytes}) >= 1")
        self.max_sessions, self.ttl_s, self.clock = max_sessions, ttl_s, clock
        self.max_session_bytes, self.on_drop = max_session_bytes, on_drop
        self._sessions: OrderedDict[str, tuple[Session, float]] = OrderedDict()
        self.dropped = 0

    def _expire(self) -> None:
        now = self.clock()
        while self._sessions:  # least recently used first: stop at the first live one
            sid, (_, used) = next(iter(self._sessions.items()))
            if now - used <= self.ttl_s:
                break
            del self._sessions[sid]
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(sid)

    def get(self, sid: str) -> Session | None:
        self._expire()
        got = self._sessions.get(sid)
        if got is None:
            return None
        self._sessions[sid] = (got[0], self.clock())
        self._sessions.move_to_end(sid)
        return got[0]

    def open(self, sid: str, encode: Encode, decode: Decode, encode_rest: Encode | None = None) -> Session:
        """The session `sid`, created on first use; SessionsFull when `max_sessions`
        live sessions are held (none is evicted for it)."""
        session = self.get(sid)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise SessionsFull(
                    f"the endpoint holds {len(self._sessions)} live sessions (rollout.openai."
                    f"max_sessions); a session is dropped when deleted or after "
                    f"{self.ttl_s:g} s idle (rollout.openai.session_ttl_s)")
            session = Session(sid, encode, decode, encode_rest)
            self._sessions[sid] = (session, self.clock())
        return session

    def check_room(self, session: Session, prompt_text: str, n_prompt_ids: int, n: int = 1) -> None:
        """Raise SessionTooLarge when recording `n` calls of this prompt would take
        `session` past `max_session_bytes` (their outputs, unknown yet, may go past by
        at most one request's budget)."""
        if self.max_session_bytes is None:
            return
        need = session.nbytes + n * record_bytes(prompt_text, n_prompt_ids, 0, [prompt_text])
        if need > self.max_session_bytes:
            raise SessionTooLarge(
                f"session {session.sid!r} would hold ~{need} bytes of recorded calls with this "
                f"one, over rollout.openai.max_session_bytes ({self.max_session_bytes}): end "
                "the episode or start another session")

    def pop(self, sid: str) -> Session | None:
        got = self._sessions.pop(sid, None)
        return got[0] if got else None

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: str) -> bool:
        """Whether `sid` is held (live or not yet expired); does not count as a use."""
        return sid in self._sessions
