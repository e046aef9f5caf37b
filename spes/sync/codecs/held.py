"""Held-model codecs: every round sends what changed since a model both ends hold, through a lossy quantizer.

Both ends hold H, the *held model*: the global model as every up-to-date peer has it, bit for bit, tagged with the
round it is of. The server keeps its global model G in full precision beside it. A round:

1. A peer sends what it trains as `quantizer.encode(theta - H + e)`, each payload tagged with H's round, and keeps
   what the quantizer missed as its error-feedback buffer e for the next round (`encode_delta`); a peer holding no
   H (the first round, joined late, caught up, or refused for its base) sends full values (fp32), and so does a
   peer for a tensor its H does not hold yet (with fragments, H fills up over the first `sync_steps` steps).
2. The server refuses a payload against another base (`spes.sync.wire.BaseMismatch`, reason `base_mismatch`: the
   peer then sends full values) and turns each of the others into values as it arrives (`HeldServer`): the peer's
   own blocks `H + delta` (what the peer itself reconstructs, so the payload can be relayed unchanged), averaged
   tensors `G + delta` (the peer's progress applied to the full-precision G, so what the last download's
   quantization left out of H stays in the model). They aggregate as on any wire (`spes.sync.merge`).
3. After the round the server makes the new held model and the payloads every up-to-date peer downloads
   (`next_held`): blocks taken verbatim relayed as uploaded, every other tensor the round changed encoded as
   `G_new - H` in the server's format (`quantizer.down`) with no carried error (the next round's delta is measured
   against what the peers then hold, which feeds the error back), a tensor new to H as its full values. The round
   is published before those are encoded: each is encoded when a download first reads it, so the encoding
   overlaps the downloads instead of delaying their first byte (`Reencoding`).
4. A peer holding the H those payloads apply to reconstructs the new one (`apply_delta(H, p)` as each arrives,
   its own blocks outside merge rounds its own upload's reconstruction); any other peer gets full values of the
   new H. Either way every peer then holds the server's H, and loads what the round served. Its own blocks
   taken verbatim it does not load: nobody else trains them, so it keeps training them as trained, and what
   their upload left out is `theta - H` at its next upload (their carried error stays as it was, see `receive`).

Sender and receiver call the same `apply_delta` (an elementwise add of the decoded fp32 delta, never a fused form; a
sparse codec's delta added at the positions it sent, `spes.sync.codecs.base.Scattered`), so they agree bit for bit.
With error feedback, the reconstructed deltas of a tensor sum over rounds to the true ones plus the first carried
error minus the last: the drift stays within one round's quantization error.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property, partial

import torch

from spes.sync.codecs.base import NO_BASE, Delta, Payload, Quantizer, Scattered
from spes.sync.codecs.interface import Selection, Served, UploadBase
from spes.sync.codecs.lazy import Lazy, Overlay
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Shape, Tensors
from spes.sync.wire import DIVERGED, NOT_PUBLISHED, Coded, Item, TensorDecoder, finite, upload_digest

REENCODE_LIMIT = 2.0**100
"""Largest magnitude the server re-encodes (`headroom`); a model's values are many orders of magnitude below."""
VALUES_DTYPE = "fp32"
"""Full values of a held-model codec travel in fp32: the held model is fp32 on every end."""


def apply_delta(
    base: torch.Tensor, payload: Payload, quantizer: Quantizer, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What a receiver holding `base` reconstructs: base + decode(payload), in fp32, cast to base's dtype; a delta
    that brings no memory of its own (`Scattered`) lands in `out`, memory a receiver keeps across rounds, when it
    fits (fp32, base's shape and device, not base itself).

    Sender and receiver must both call this (not a fused or reordered form of it) to agree bit for bit:
    an elementwise add is exactly rounded on any device, a fused multiply-add is not the same.
    """
    return _apply(base, payload, quantizer.delta(payload), out)


def _apply(base: torch.Tensor, payload: Payload, delta: Delta, out: torch.Tensor | None) -> torch.Tensor:
    """`apply_delta` of a payload whose `delta` its quantizer already made (a caller that reads it again)."""
    if tuple(base.shape) != tuple(payload.shape):
        raise ValueError(
            f"tensor {payload.name!r}: delta of shape {list(payload.shape)} against a base of shape {list(base.shape)}"
        )
    fits = (
        out is not None
        and out is not base
        and (out.shape, out.dtype, out.device) == (base.shape, torch.float32, base.device)
    )
    return _plus(base, delta, out if fits else None)


def _plus(base: torch.Tensor, delta: Delta, out: torch.Tensor | None = None) -> torch.Tensor:
    """base + delta in fp32, cast to base's dtype: a dense delta is summed into itself (which it consumes: it is
    fresh memory already, and one more tensor to write would cost more); a `Scattered` one into a copy of base, in
    `out` when given, at its positions only (an entry it does not touch keeps base's bits)."""
    if isinstance(delta, Scattered):
        copy = base.to(torch.float32, copy=True) if out is None else out.copy_(base)
        return _add(copy, delta, 1).to(base.dtype)
    return delta.to(base.device).add_(base.float()).to(base.dtype)


def _add(out: torch.Tensor, delta: Delta, sign: int) -> torch.Tensor:
    """out += sign * delta, in place (out fp32); each entry is rounded once, as a dense add would round it."""
    if isinstance(delta, Scattered):
        out.view(-1).index_add_(0, delta.positions.to(out.device), delta.values.to(out.device), alpha=sign)
        return out
    return out.add_(delta.to(out.device), alpha=sign)


def apply_finite(
    base: torch.Tensor, payload: Payload, quantizer: Quantizer, out: torch.Tensor | None, non_finite: str
) -> torch.Tensor:
    """`apply_delta` of a finite `base`, refused when the result holds NaN or Inf (ValueError naming the tensor and
    `non_finite`, what such values mean where the payload came from); only the entries the delta changed are
    checked."""
    delta = quantizer.delta(payload)
    value = _apply(base, payload, delta, out)
    if not finite(changed(value, delta)):
        raise ValueError(
            f"tensor {payload.name!r} holds NaN or Inf values once its {quantizer.name} delta is applied: {non_finite}"
        )
    return value


def changed(value: torch.Tensor, delta: Delta) -> torch.Tensor:
    """The entries of `value` (a base plus `delta`) that the delta may have changed: all of them, or a `Scattered`
    delta's positions. A check of those for NaN and Inf covers the whole of a finite base's result."""
    return value.view(-1)[delta.positions.to(value.device)] if isinstance(delta, Scattered) else value


@dataclass(frozen=True)
class EncodedDelta:
    """What `encode_delta` returns: the payload to send and what both ends make of it."""

    payload: Payload
    error: torch.Tensor
    """The carried error for the next delta of this tensor: target - decode(payload), fp32."""
    _base: torch.Tensor
    _delta: Delta

    @cached_property
    def reconstruction(self) -> torch.Tensor:
        """`apply_delta(base, payload)`: what the receiver will hold, bit for bit. Made when first read: a peer
        needs it only for the blocks it owns."""
        return _plus(self._base, self._delta)


def encode_delta(
    quantizer: Quantizer, name: str, value: torch.Tensor, base: torch.Tensor, carried: torch.Tensor | None = None
) -> EncodedDelta:
    """Encode `value - base + carried` with error feedback (`carried` None: no error carried yet).

        target = value - base + carried;  payload = encode(target);  error = target - decode(payload)

    The new error is measured on the delta (what the receiver's `decode` misses), so the sum of reconstructed
    deltas over rounds equals the sum of true deltas plus the first carried error minus the last.
    """
    for what, tensor in (("base", base), ("carried error", carried)):
        if tensor is not None and tuple(tensor.shape) != tuple(value.shape):
            raise ValueError(f"tensor {name!r}: shape {list(value.shape)}, its {what} has shape {list(tensor.shape)}")
    target = value.float() - base.float().to(value.device)
    if carried is not None:
        target += carried.to(value.device)
    payload = quantizer.encode(name, target)
    delta = quantizer.delta(payload)
    error = _add(target, delta, -1)  # NOTE: in place, as every step below: a large tensor is held at most twice more
    return EncodedDelta(payload, error, base, delta)


def next_held(
    quantizer: Quantizer,
    step: int,
    new_global: Tensors,
    previous: Served | None,
    names: Collection[str],
    relayed: Mapping[str, Payload],
) -> Served:
    """The held model of round `step` from its global model, and the payloads that take the peers there.

    `names`: the tensors the round changed (a fragment's round changes only its own; the others keep their held
    values and send nothing). `relayed`: the uploaded payloads of blocks taken verbatim (none on merge rounds),
    whose new global already is `apply_delta(H, payload)`, sent on as they came so nothing is quantized twice. A
    tensor the previous held model lacks (its fragment's first round) is held and sent as its full values.
    Without a previous held model (the first round, or a restarted server) the held model is the global model
    itself, and every peer gets it as full values.

    Every other tensor is re-encoded (`Reencoding`): its payload and held value are made when a download first
    reads them, so the round is published before they are. What could fail there is checked here (`headroom`).
    """
    if previous is None:
        return Served(step, dict(new_global))
    held: dict[str, torch.Tensor] = {}
    deltas: dict[str, Item] = {}
    coded = []
    for name in names:
        if name not in previous.tensors:
            deltas[name] = held[name] = new_global[name]
        elif name in relayed:
            deltas[name], held[name] = Coded(relayed[name], previous.round), new_global[name]
        else:
            headroom(name, new_global[name], previous.tensors[name])
            coded.append(name)
    later = Reencoding(quantizer.down, previous.round, new_global, previous.tensors, coded)
    kept = {n: t for n, t in {**previous.tensors, **held}.items() if n not in later.names}
    tensors = Overlay([n for n in new_global if n in kept or n in later.names], kept, later.held)
    return Served(step, tensors, Overlay(list(names), deltas, later.item), previous.round, later)


def headroom(name: str, value: torch.Tensor, base: torch.Tensor) -> None:
    """ValueError naming `name` unless re-encoding `value` against `base` surely stays finite, so that it may be
    left to a download: max |value| + 2 max |base| bounds the delta value - base and what a receiver makes of
    base + decode(delta) (|decode| is at most the delta's largest magnitude), and `REENCODE_LIMIT` leaves room for
    a codec's intermediate products (a level times its scale)."""
    if not value.numel():
        return
    bound = sum(w * float(max(-lo, hi)) for w, (lo, hi) in ((1, torch.aminmax(value)), (2, torch.aminmax(base))))
    if not bound <= REENCODE_LIMIT:  # NOTE: also False for NaN
        raise ValueError(
            f"tensor {name!r} holds NaN or Inf values, or values beyond {REENCODE_LIMIT:.0e} (fp32's range is "
            "3e38): the global model diverged"
        )


class Reencoding:
    """The tensors of a round's held model that the server re-encodes (`next_held`), each made once, when first
    read: by a download, which sends the first while the next are made, or by the closing thread (`complete`).
    Thread-safe (`spes.sync.codecs.lazy.Lazy`). Until made, a tensor's global value and held base stay alive;
    once made, only what it was made into."""

    def __init__(
        self,
        quantizer: Quantizer,
        base_round: int,
        new_global: Tensors,
        base: Mapping[str, torch.Tensor],
        names: list[str],
    ) -> None:
        self._names = frozenset(names)
        self._of = {n: (new_global[n], base[n]) for n in names}
        # NOTE: not a bound method: `self` -> make -> `self` would be a reference cycle, keeping a round's tensors
        # for the cycle collector instead of freeing them with the round
        self._made = Lazy(names, partial(_reencode, quantizer, base_round, self._of))

    @property
    def names(self) -> Collection[str]:
        return self._names

    def item(self, name: str) -> Item:
        return self._made[name][0]

    def held(self, name: str) -> torch.Tensor:
        return self._made[name][1]

    def holds(self) -> list[torch.Tensor]:
        of = dict(self._of)  # NOTE: before `made`: a name leaves `_of` when made, before `made` has it
        return [*(t for pair in of.values() for t in pair), *(held for _, held in self._made.made().values())]

    def complete(self) -> None:
        self._made.complete()


def _reencode(
    quantizer: Quantizer, base_round: int, of: dict[str, tuple[torch.Tensor, torch.Tensor]], name: str
) -> tuple[Coded, torch.Tensor]:
    """One tensor of `Reencoding`: its coded delta from its held base, and what the peers will hold."""
    sent = encode_delta(quantizer, name, *of[name])
    del of[name]  # NOTE: the previous held value may go back to the server's pool once its round does
    return Coded(sent.payload, base_round), sent.reconstruction


class HeldPeer:
    """A peer's end (`spes.sync.codecs.base.PeerCodec`): its held model, that model's round, the carried error,
    and the upload in flight. The held tensors are the peer's own: the caller loads them and must not change them."""

    raw_dtype = VALUES_DTYPE

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer
        self.held: Tensors = {}
        self.round: int | None = None
        self.carried: Tensors = {}
        """Per trained tensor, what quantization left out of the last upload (added to the next delta)."""
        self._pending: tuple[Tensors, Tensors] = ({}, {})
        """The upload in flight, of each item made so far: its carried error, and the reconstructions of the tensors
        it may not download."""
        self._upload: Lazy[Item] | None = None
        self._spare: Tensors = {}
        """The held model before the last `receive`: a download into kept buffers (`SyncClient`'s `reuse_buffers`,
        whose caller copies a round's result out before the next) applies its sparse deltas into the tensors that
        round replaced, so they fault in no fresh memory. A tensor it kept is its delta's base, which `apply_delta`
        never writes into."""

    @property
    def base_round(self) -> int:
        return NO_BASE if self.round is None else self.round

    def upload(self, trained: Mapping[str, torch.Tensor], own: Collection[str]) -> Mapping[str, Item]:
        """Coded deltas against the held model, each made when a plane first reads it (its first bytes go while
        the rest is encoded); full values without one, or for a tensor it does not hold yet (its own blocks among
        those are then held as sent: nobody sends them back)."""
        self._pending, self._upload = ({}, {}), None
        if self.round is None:
            return dict(trained)
        make = partial(self._item, trained, frozenset(own), self.round, self._pending)
        self._upload = Lazy(trained, make)
        return self._upload

    def _item(
        self,
        trained: Mapping[str, torch.Tensor],
        own: Collection[str],
        base_round: int,
        pending: tuple[Tensors, Tensors],
        name: str,
    ) -> Item:
        """One item of the upload in flight; its carried error and, for an own block, what it becomes are kept in
        `pending`, that upload's own (a sending thread still running after a retry began writes nothing into the
        retry's)."""
        errors, reconstructions = pending
        value = trained[name]
        if name not in self.held:
            item = value.detach().to(torch.float32, copy=True)
            if name in own:
                reconstructions[name] = item
            return item
        sent = encode_delta(self.quantizer, name, value, self.held[name], self.carried.get(name))
        errors[name] = sent.error
        if name in own:
            reconstructions[name] = sent.reconstruction
        return Coded(sent.payload, base_round)

    def digest(self, trained: Mapping[str, torch.Tensor]) -> int:
        """What the upload is made of: the values, and with a held model its round and the carried errors (equal
        inputs make equal payloads), so it is known before any payload is made."""
        if self.round is None:
            return upload_digest(trained, VALUES_DTYPE)
        made_of = {f"{self.round}/{n}": v for n, v in trained.items()}
        made_of.update({f"carried/{n}": self.carried[n] for n in trained if n in self.carried})
        return upload_digest(made_of, VALUES_DTYPE)

    def decoder(self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor] | None) -> TensorDecoder:
        """Payloads against the held model, each applied to it as it arrives (the work overlaps the rest of the
        download; the held model itself changes only in `receive`), into the tensors the last round replaced when
        the client keeps its buffers (`into`); or full values into fresh tensors (they become the held model)."""
        spare = self._spare if into is not None else {}
        return TensorDecoder(
            expected,
            VALUES_DTYPE,
            non_finite=NOT_PUBLISHED,
            coded=self.quantizer,
            base_round=self.base_round,
            apply=partial(self._applied, spare),
        )

    def _applied(self, spare: Tensors, payload: Payload) -> torch.Tensor:
        """What the held model becomes with `payload`, in its spare tensor when there is one (ValueError for a tensor
        it does not hold)."""
        base = self.held.get(payload.name)
        if base is None:
            raise ValueError(f"tensor {payload.name!r}: a delta against a held model that does not hold it")
        return apply_finite(base, payload, self.quantizer, spare.get(payload.name), NOT_PUBLISHED)

    def whole(self, info: pb.RoundInfo) -> bool:
        if info.base_round != NO_BASE and info.base_round != self.base_round:
            raise ValueError(
                f"round {info.round}: payloads against the held model of round {info.base_round}, but this peer "
                f"holds {self.base_round}"
            )
        return info.base_round == NO_BASE

    def receive(
        self, info: pb.RoundInfo, decoder: TensorDecoder, *, caught_up: bool, serves: Collection[str] | None = None
    ) -> Tensors:
        """The new held model of the tensors the round served, as a raw codec returns what it downloaded: with
        fragments a round serves one fragment, and the node's other tensors keep their local progress. Full values
        (no base) are the whole held model, loaded whole by a peer that catches up (`serves` None). A peer that took
        part in the round gets them when it held no model (its first round, or after `forget`) or from a restarted
        server (its restored round holds no deltas): it holds them all but loads only `serves`, as on a raw wire
        (the other fragments keep their local progress); a peer that held a model commits the rest as deltas would
        have brought it, so its run goes on as if the server had never stopped. A peer that caught up drops its
        carried error (its upload was not taken); otherwise the upload's errors replace those of the tensors it coded,
        and every other tensor's (a fragment not synchronized this round) stays carried until its own round.

        The peer's own blocks that the server took verbatim (not served back: a round without merging) are held
        as their upload's reconstruction H' = H + decode(p) but not returned, so the node keeps them as it trained
        them, as on a raw wire. What the upload left out then stays in theta - H', so their carried error e stays
        as it was: what the node still owes is theta - H + e before the round and theta - H' + e after it.
        """
        values = {**decoder.finish(), **decoder.applied}
        if self._upload is not None and not caught_up:
            self._upload.complete()  # NOTE: a duplicate's items were never read, but the server took them
        whole = info.base_round == NO_BASE
        relayed: Tensors = {}
        if whole and serves is None:
            held, served = values, dict(values)
        else:
            # NOTE: the client checked the announced names; a tensor the round did not change keeps its held value.
            # Full values hold this peer's own blocks as the server took them: its upload's reconstructions, bit for bit
            served = {n: values[n] for n in serves or () if n in values} if whole else values
            relayed = {n: t for n, t in self._pending[1].items() if n not in served}
            held = values if whole else {**self.held, **relayed, **served}
        errors = {n: e for n, e in self._pending[0].items() if n not in relayed}
        self._spare, self.held, self.round = self.held, held, info.round
        self.carried = {} if caught_up else {**self.carried, **errors}
        self._pending, self._upload = ({}, {}), None
        return served

    def forget(self) -> bool:
        """Drop the held model and the carried error: the next upload is full values."""
        had = self.round is not None
        self.held, self.round, self.carried, self._spare = {}, None, {}, {}
        self._pending, self._upload = ({}, {}), None
        return had

    def state_dict(self) -> tuple[dict[str, str], Tensors]:
        if self.round is None:
            return {}, {}
        tensors = {
            **{f"held/{n}": t for n, t in self.held.items()},
            **{f"carried/{n}": t for n, t in self.carried.items()},
        }
        return {"codec": self.quantizer.name, "round": str(self.round)}, tensors

    def load_state_dict(self, metadata: Mapping[str, str], tensors: Tensors) -> None:
        if not metadata:
            self.forget()
            return
        if metadata.get("codec") != self.quantizer.name:
            raise ValueError(f"codec state of {metadata.get('codec')!r}, this run's codec is {self.quantizer.name!r}")
        self.round, self._spare = _held_round(metadata.get("round")), {}
        self.held = {n.removeprefix("held/"): t for n, t in tensors.items() if n.startswith("held/")}
        self.carried = {n.removeprefix("carried/"): t for n, t in tensors.items() if n.startswith("carried/")}


def _held_round(value: str | None) -> int:
    """The round a saved codec state holds its model of: a number >= 0, else the state is damaged (ValueError)."""
    if value is None or not value.isdecimal():
        raise ValueError(
            f"codec state: held round {value!r} is not a round number: the checkpoint is damaged; load an older one "
            "with --load_path=<save_folder>/step<N>"
        )
    return int(value)


class HeldServer:
    """The server's end (`spes.sync.codecs.base.ServerCodec`): served rounds carry the held model and its deltas."""

    raw_dtype = VALUES_DTYPE

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer

    def upload_decoder(
        self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor], base: UploadBase
    ) -> TensorDecoder:
        """Full values into `into`; each payload applied as it arrives (`_applied`, also into `into`), so the work
        overlaps the rest of the upload and of the other peers' uploads."""
        return TensorDecoder(
            expected,
            VALUES_DTYPE,
            into=into,
            non_finite=DIVERGED,
            coded=self.quantizer,
            base_round=NO_BASE if base.served is None else base.served.round,
            apply=partial(self._applied, base, into),
        )

    def _applied(self, base: UploadBase, into: Mapping[str, torch.Tensor], payload: Payload) -> torch.Tensor:
        """A payload applied to the held model (a block taken verbatim: what the peer reconstructs) or to the global
        model (an averaged tensor), into the upload's kept buffer for it (no fresh memory); ValueError naming a
        tensor the base lacks or that is not finite once applied (both models are finite: a round is published
        only so, so the entries the delta changed are checked)."""
        assert base.served is not None  # the decoder refuses every payload when no round has completed
        model = base.served.tensors if payload.name in base.verbatim else base.global_model
        if payload.name not in model:
            raise ValueError(f"tensor {payload.name!r}: a delta against a model that does not hold it")
        return apply_finite(model[payload.name], payload, self.quantizer, into.get(payload.name), DIVERGED)

    def upload_values(
        self, decoder: TensorDecoder, raw: Tensors, base: UploadBase
    ) -> tuple[Tensors, dict[str, Payload]]:
        """Full values as received, and each payload as applied on arrival."""
        return {**raw, **decoder.applied}, {n: decoder.coded[n].payload for n in base.verbatim if n in decoder.coded}

    def serve(
        self,
        step: int,
        global_model: Tensors,
        previous: Served | None,
        names: Collection[str],
        relayed: Mapping[str, Payload],
    ) -> Served:
        return next_held(self.quantizer, step, global_model, previous, names, relayed)

    def select(self, served: Served, *, full: bool, base_round: int) -> Selection:
        """Deltas for a peer holding the base they apply to; every tensor of the held model for any other."""
        if not full and served.base is not None and base_round == served.base:
            return Selection(served.deltas, "deltas", whole=False, base_round=served.base)
        return Selection(served.tensors, "held", whole=True)

    def persisted(self, served: Served) -> Tensors:
        return dict(served.tensors)

    def restore(self, step: int, global_model: Tensors, persisted: Tensors) -> Served:
        return Served(step, persisted or dict(global_model))
