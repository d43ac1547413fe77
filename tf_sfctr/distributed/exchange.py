"""All-to-all routing of a model-parallel table's ids, rows and gradients.

Each rank owns the ids with ``owner(id) = Mix64(id) mod world_size``. A step
sends every rank's distinct ids to their owners (``hvd.alltoall`` with
splits), the owners answer with rows in the order they received the ids, and
in the backward pass the same route carries gradients to the owners. Only
distinct (id, owner) pairs cross the wire: ids are de-duplicated before they
are bucketed. Uneven and empty splits are normal.

The inputs of a training or inference step's all-to-alls are padded to a
steady length (:func:`steady_length`); Horovod sends only the splits' rows,
and an input shape that rarely changes lets its response cache skip the
negotiation of the all-to-all.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_sfctr import _ops
from tf_sfctr._splitmix import mix
from tf_sfctr.distributed._horovod import require
from tf_sfctr._checks import ArgumentTypeError


def owner_of(ids: np.ndarray, world_size: int) -> np.ndarray:
    """Owner rank of each id, Mix64(id) mod world_size: the grouping
    ``SfctrUnique(ids, num_groups=world_size)`` routes by, in NumPy."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise ArgumentTypeError(f"world_size must be a positive int (the number of ranks), "
                                f"got {world_size!r}")
    if not 1 <= world_size <= np.iinfo(np.int32).max:
        raise ValueError(f"world_size must be a positive int (the number of ranks), "
                         f"got {world_size!r}")
    values = np.asarray(ids)
    if values.dtype.kind not in "iu" and values.size:
        # (np.asarray(ids, np.int64) cut 1.9 to the id 1, and said "invalid
        # literal for int()" of a string)
        raise ArgumentTypeError(f"owner_of: ids must be integers, got {values.dtype} values")
    x = mix(values.astype(np.int64).astype(np.uint64))  # (a copy: mixed in place)
    return (x % np.uint64(world_size)).astype(np.int32)


class Route(NamedTuple):
    """How one step's distinct ids were sent to their owners.

    "Route order" is the order the ids were sent in: local unique ids grouped
    by owner. ``position[i]`` is where local unique id ``i`` went.
    """

    position: tf.Tensor     # local unique id i -> its index in route order
    splits: tf.Tensor       # ids sent to each rank
    recv_ids: tf.Tensor     # ids received by this rank (as owner)
    recv_splits: tf.Tensor  # how many came from each rank


_POWERS_OF_TWO = [1 << j for j in range(63)]


def steady_length(n) -> tf.Tensor:
    """The length an all-to-all input of ``n`` rows is padded to (int64): ``n``
    rounded up to a multiple of ``2 ** (bit_length(n) - 4)``, so less than 1/8
    of padding and at most 16 lengths per doubling of ``n``.

    Horovod negotiates an all-to-all (which ranks are ready, in a gather and
    a broadcast between the ranks) unless its response cache holds the same
    tensor name with the same shape; a step's message sizes change every
    step, but their steady lengths rarely do. Measured on 2 ranks of the
    reference workload: 0.3-2.8 ms of a 26-33 ms step (docs/design.md). The
    ``SfctrFrame`` kernel's ``steady`` attribute applies the same rule."""
    n = tf.cast(n, tf.int64)
    bits = tf.reduce_sum(tf.cast(n >= tf.constant(_POWERS_OF_TWO, tf.int64), tf.int64))
    granule = tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.maximum(bits - 4, 0))
    return (n + granule - 1) // granule * granule


def pad_steady(x: tf.Tensor, extra=0) -> tf.Tensor:
    """``x`` with zero rows appended up to :func:`steady_length` of its first
    dimension; an all-to-all of it with the splits of ``x`` sends the same.
    ``extra`` (a scalar): at least that many zero rows more (see
    :func:`return_rows`)."""
    n = tf.shape(x, out_type=tf.int64)[0]
    paddings = tf.concat([[[0, steady_length(n + tf.cast(extra, tf.int64)) - n]],
                          tf.zeros([len(x.shape) - 1, 2], tf.int64)], axis=0)
    return tf.pad(x, paddings)


def send_ids(unique_ids: tf.Tensor, world_size: int, name: str) -> Route:
    """Buckets distinct ids by owner and delivers them (one all-to-all)."""
    routed, position, splits = _ops.unique(unique_ids, num_groups=world_size)
    return _deliver(routed, position, splits, name)


def route_batch(ids: tf.Tensor, world_size: int, name: str) -> tuple[Route, tf.Tensor]:
    """De-duplicates a batch's ids, grouped by owner, and delivers them (one
    all-to-all). Returns the route and, for every id of ``ids``, the index of
    its row in route order (what ``tf.gather(route.position, inverse)`` gives
    after ``tf.unique`` and :func:`send_ids`, in one pass)."""
    routed, inverse, splits = _ops.unique(ids, num_groups=world_size)
    # The local unique ids are the routed ones: position is the identity.
    return _deliver(routed, tf.range(tf.size(routed)), splits, name), inverse


class Extras(NamedTuple):
    """What an owner received beside a step's ids (see :func:`send_ids_with_extras`)."""

    next_ids: Optional[tf.Tensor]    # the next batch's ids this rank owns
    hint_ids: Optional[tf.Tensor]    # hinted ids this rank owns (may repeat)
    hint_steps: Optional[tf.Tensor]  # int32, batches after this one
    carried: Optional[tf.Tensor] = None  # float32 rows sent with `carried`, by sender


# Sections of a framed ids message, in order; the header holds their sizes.
_THIS, _NEXT, _HINT_IDS, _HINT_STEPS, _CARRIED = range(5)
_SECTIONS = 5


def send_ids_with_extras(unique_ids: Optional[tf.Tensor], world_size: int, name: str,
                         next_ids: Optional[tf.Tensor] = None,
                         hints: Optional[tuple[tf.Tensor, tf.Tensor]] = None,
                         carried: Optional[tuple[tf.Tensor, tf.Tensor]] = None,
                         ids: Optional[tf.Tensor] = None):
    """:func:`send_ids` for this step's distinct ids plus, in the same
    all-to-all, the next step's distinct ids (lookahead), eviction hints
    ``(ids, steps)``, each sent to the owner of its id, and ``carried``
    rows: ``(rows, splits)``, float32 ``[R, w]`` rows in destination order,
    ``splits[r]`` of them for rank r (a deferred table update).

    The next ids arrive in the order a later ``send_ids(next_ids)`` would
    deliver them. Hints keep the smallest ``steps`` of an id that repeats in
    ``hints``; an owner may still receive one id from several ranks. Carried
    rows arrive grouped by sender, in rank order.

    With ``ids`` instead of ``unique_ids`` (None), the batch is de-duplicated
    here, as :func:`route_batch` does, and the result is ``(route, extras,
    index)`` with the route-order index of every id; else ``(route,
    extras)``.

    Each rank's message to rank r is a header of five counts followed by
    those sections: this step's ids for r, next ids for r, hinted ids for r,
    their steps, and the carried rows for r (as float64 words). Every rank
    sends the five sections (empty when it has nothing), so ranks always
    agree on the framing. The message travels as float64 bits with next ids
    or hints and as int64 bits without, so that ranks that disagree on
    sending them at all (lookahead or hints on some ranks only, a
    misconfigured input pipeline) fail on every rank with Horovod's
    "Mismatched data types" rather than silently lose the lookahead.
    """
    hvd = require()
    if unique_ids is None:
        routed, index, splits = _ops.unique(ids, num_groups=world_size)
        position = tf.range(tf.size(routed))
    else:
        routed, position, splits = _ops.unique(unique_ids, num_groups=world_size)
    sections, counts = [routed], [splits]
    empty = tf.zeros([0], tf.int64)
    no_split = tf.zeros([world_size], tf.int32)
    if next_ids is not None:
        routed_next, _, splits_next = _ops.unique(next_ids, num_groups=world_size)
        sections.append(routed_next)
        counts.append(splits_next)
    else:
        sections.append(empty)
        counts.append(no_split)
    if hints is not None:
        hint_ids, hint_steps = hints
        routed_hints, where, splits_hints = _ops.unique(hint_ids, num_groups=world_size)
        steps = tf.math.unsorted_segment_min(hint_steps, where, tf.size(routed_hints))
        sections += [routed_hints, tf.cast(steps, tf.int64)]
        counts += [splits_hints, splits_hints]
    else:
        sections += [empty, empty]
        counts += [no_split, no_split]
    sections = [tf.bitcast(x, tf.float64) for x in sections]
    # The carried rows go as float64 words, each destination's contiguous
    # (the rows are in destination order).
    width = None
    if carried is not None:
        rows, rows_splits = carried
        width = rows.shape[1]
        words = _as_words(rows)
        carried_words = tf.reshape(words, [-1])
        carried_counts = rows_splits * words.shape[1]
    else:
        carried_words = tf.zeros([0], tf.float64)
        carried_counts = no_split

    counts.append(carried_counts)
    kernels = _ops.use_kernels()
    if kernels:
        message, send_splits = _ops.frame(sections + [carried_words], counts, steady=True)
    else:
        message, send_splits = _frame_stock(sections, counts, carried_words,
                                            carried is not None, world_size)
        message = pad_steady(message)
    # The all-to-all only copies bytes; the dtype it is told says whether
    # extras are sent (see above).
    as_type = tf.float64 if (next_ids is not None or hints is not None) else tf.int64
    received, recv_sizes = hvd.alltoall(tf.bitcast(message, as_type), splits=send_splits,
                                        name=f"{name}_ids", ignore_name_scope=True)
    received = tf.bitcast(received, tf.float64)
    if kernels:
        parts, got = _ops.unframe(received, recv_sizes, _SECTIONS)
    else:
        parts, got = _unframe_stock(received, recv_sizes, carried is not None, world_size)

    def section(k):
        return tf.bitcast(parts[k], tf.int64)

    recv_carried = _from_words(parts[_CARRIED], width) if carried is not None else None
    route = Route(position, splits, section(_THIS), got[:, _THIS])
    extras = Extras(
        next_ids=section(_NEXT) if next_ids is not None else None,
        hint_ids=section(_HINT_IDS) if hints is not None else None,
        hint_steps=(tf.cast(section(_HINT_STEPS), tf.int32) if hints is not None else None),
        carried=recv_carried)
    return (route, extras) if unique_ids is not None else (route, extras, index)


def _frame_stock(sections, counts, carried_words, has_carried: bool, world_size: int):
    """:func:`tf_sfctr._ops.frame` of ``sections + [carried_words]`` with
    stock TF ops (the path of GPU machines). The id sections and the header
    are gathered per destination (few words); the carried rows, most of the
    bytes, are only sliced."""
    header = tf.cast(tf.stack(counts, axis=1), tf.int64)         # [world, 5]
    sizes = [tf.size(x) for x in sections]
    offsets = tf.cumsum(tf.stack(sizes), exclusive=True)
    header_at = tf.reduce_sum(tf.stack(sizes))
    pieces = [tf.RaggedTensor.from_tensor(
        header_at + tf.reshape(tf.range(world_size * _SECTIONS), [world_size, _SECTIONS]))]
    for k, c in enumerate(counts[:_CARRIED]):
        starts = tf.cumsum(c, exclusive=True) + tf.cast(offsets[k], tf.int32)
        pieces.append(tf.ragged.range(starts, starts + c))
    picks = tf.concat(pieces, axis=1).flat_values
    source = tf.concat(sections + [tf.bitcast(tf.reshape(header, [-1]), tf.float64)], axis=0)
    id_words = tf.gather(source, picks)
    id_counts = _SECTIONS + tf.add_n(counts[:_CARRIED])
    carried_counts = counts[_CARRIED]
    if not has_carried:
        return id_words, id_counts + carried_counts
    message = tf.concat(_interleave(id_words, id_counts, carried_words, carried_counts,
                                    world_size), axis=0)
    return message, id_counts + carried_counts


def _unframe_stock(received, recv_sizes, has_carried: bool, world_size: int):
    """:func:`tf_sfctr._ops.unframe` with stock TF ops: ``(sections,
    counts)``. Without carried rows the last section is empty."""
    heads = tf.cumsum(recv_sizes, exclusive=True)
    got = tf.cast(tf.bitcast(tf.gather(received, heads[:, None] + tf.range(_SECTIONS)[None, :]),
                             tf.int64), tf.int32)                 # [world, 5]
    carried_words = tf.zeros([0], tf.float64)
    if has_carried:
        # Split each sender's part into its id words and its carried words.
        recv_id_counts = _SECTIONS + tf.reduce_sum(got[:, :_CARRIED], axis=1)
        parts = _deinterleave(received, recv_id_counts, got[:, _CARRIED], world_size)
        received = tf.concat(parts[0::2], axis=0)
        carried_words = tf.concat(parts[1::2], axis=0)
        heads = tf.cumsum(recv_id_counts, exclusive=True)
    section_starts = heads[:, None] + _SECTIONS + tf.cumsum(got, axis=1, exclusive=True)

    def section(k):
        first = section_starts[:, k]
        return tf.gather(received, tf.ragged.range(first, first + got[:, k]).flat_values)

    return [section(k) for k in range(_CARRIED)] + [carried_words], got


def _interleave(a, a_counts, b, b_counts, world_size: int) -> list:
    """[a's part for rank 0, b's part for rank 0, a's for rank 1, ...]: the
    parts are consecutive in a and in b, of the given lengths."""
    a_starts = tf.cumsum(a_counts, exclusive=True)
    b_starts = tf.cumsum(b_counts, exclusive=True)
    out = []
    for r in range(world_size):
        out.append(tf.slice(a, a_starts[r:r + 1], a_counts[r:r + 1]))
        out.append(tf.slice(b, b_starts[r:r + 1], b_counts[r:r + 1]))
    return out


def _deinterleave(x, a_counts, b_counts, world_size: int) -> list:
    """Inverse of :func:`_interleave`: the 2 x world parts of x, in order."""
    lengths = tf.reshape(tf.stack([a_counts, b_counts], axis=1), [-1])
    starts = tf.cumsum(lengths, exclusive=True)
    return [tf.slice(x, starts[i:i + 1], lengths[i:i + 1]) for i in range(2 * world_size)]


def _as_words(rows: tf.Tensor) -> tf.Tensor:
    """float32 [R, w] -> float64 [R, ceil(w / 2)] holding the same bits (a
    zero column pads an odd width)."""
    w = rows.shape[1]
    if w % 2:
        rows = tf.pad(rows, [[0, 0], [0, 1]])
        w += 1
    return tf.bitcast(tf.reshape(rows, [-1, w // 2, 2]), tf.float64)


def _from_words(words: tf.Tensor, width: int) -> tf.Tensor:
    """Inverse of :func:`_as_words` for flat words of rows of ``width`` floats."""
    half = (width + 1) // 2
    rows = tf.reshape(tf.bitcast(tf.reshape(words, [-1, half]), tf.float32), [-1, 2 * half])
    return rows[:, :width]


def send_rows(rows: tf.Tensor, splits: tf.Tensor, name: str) -> tf.Tensor:
    """Rows in destination order (``splits[r]`` for rank r) to their ranks;
    returns the rows received, grouped by sender in rank order."""
    hvd = require()
    out, _ = hvd.alltoall(rows, splits=splits, name=name, ignore_name_scope=True)
    return out


def _deliver(routed, position, splits, name) -> Route:
    hvd = require()
    recv_ids, recv_splits = hvd.alltoall(pad_steady(routed), splits=splits,
                                         name=f"{name}_ids", ignore_name_scope=True)
    return Route(position, splits, recv_ids, recv_splits)


def return_rows(rows_for_recv: tf.Tensor, route: Route, name: str,
                refusal: Optional[tf.Tensor] = None):
    """Owner → requester: rows in route order (local unique id ``i`` is row
    ``route.position[i]``; callers fold that into their own gather).
    ``rows_for_recv`` holds a row for each of ``route.recv_ids`` and may go on
    with padding (gathered with a :func:`pad_steady` index), which stays here.

    ``refusal`` (an int32 scalar, given on every rank or on none): 0 when
    this owner answers, else a code >= 1 for why it cannot (its rows are
    then meaningless). The owner sends every rank that many rows more than
    asked for (``rows_for_recv`` must hold them: ``pad_steady(index,
    extra=refusal * world size)``), so every rank learns every owner's code
    in this all-to-all, also from an owner it asked for nothing, and no
    rank is left waiting in a later collective. Returns ``(rows, codes)``
    then, ``codes[r]`` owner r's refusal."""
    hvd = require()
    splits = route.recv_splits
    if refusal is not None:
        splits += tf.cast(refusal, splits.dtype)
    back, got = hvd.alltoall(rows_for_recv, splits=splits,
                             name=f"{name}_rows", ignore_name_scope=True)
    if refusal is None:
        return back
    return back, tf.cast(got - route.splits, tf.int32)


def send_to_owners(per_unique: tf.Tensor, route: Route, name: str) -> tf.Tensor:
    """Requester → owner: one row per local unique id (in unique-id order),
    arriving in the order of ``route.recv_ids``."""
    hvd = require()
    # route.position is a permutation here (the ids were distinct); its
    # inverse lists the local unique ids in route order.
    payload = tf.gather(per_unique, tf.math.invert_permutation(route.position))
    out, _ = hvd.alltoall(payload, splits=route.splits,
                          name=f"{name}_grads", ignore_name_scope=True)
    return out
