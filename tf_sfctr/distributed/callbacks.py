"""Keras callbacks for Horovod training (Keras 3, core Horovod ops only)."""

from __future__ import annotations

import hashlib
import json
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_sfctr.distributed._horovod import require


def _histories(node_args) -> list:
    """Names of the layers whose outputs a serialized call's arguments use."""
    found = []
    if isinstance(node_args, dict):
        history = (node_args.get("config") or {}).get("keras_history") \
            if node_args.get("class_name") == "__keras_tensor__" else None
        if history:
            found.append(history[0])
        else:
            for value in node_args.values():
                found.extend(_histories(value))
    elif isinstance(node_args, (list, tuple)):
        for value in node_args:
            found.extend(_histories(value))
    return found


def _table_wiring(config: dict, prefix: str = "") -> list:
    """For each CachedEmbedding of a serialized functional model (nested
    ones too): its name and the model inputs that feed it."""
    layers = config.get("layers") or []
    by_name = {entry.get("name", (entry.get("config") or {}).get("name")): entry
               for entry in layers if isinstance(entry, dict)}

    def inputs_of(name, seen):
        entry = by_name.get(name)
        if entry is None or name in seen:
            return set()
        seen.add(name)
        if entry.get("class_name") == "InputLayer":
            return {name}
        found = set()
        for producer in _histories(entry.get("inbound_nodes") or []):
            found |= inputs_of(producer, seen)
        return found

    wiring = []
    for name, entry in by_name.items():
        if entry.get("class_name") == "CachedEmbedding":
            wiring.append((prefix + name, sorted(inputs_of(name, set()))))
        elif isinstance(entry.get("config"), dict) and "layers" in entry["config"]:
            wiring.extend(_table_wiring(entry["config"], f"{prefix}{name}/"))
    return sorted(wiring)


def _check_same_tables(model, call: str) -> None:
    """Collective: refuses, on every rank, ranks in different Keras calls
    (``call``: "fit", "evaluate" or "predict"; their steps run other
    collectives, so they waited for each other forever, or one rank's
    predict was answered by the other's evaluate), and models whose
    CachedEmbedding layers are wired to other inputs on other ranks. Ranks pair a layer's
    collectives by its name, and Keras names layers in creation order: a
    model built by looping over a set of features (whose order differs
    between processes) would train each rank's features into other
    features' tables, or hang. (A subclassed model has no serialized
    wiring to compare: nothing is checked then, but every rank still takes
    part in the reduction.)"""
    try:
        wiring = _table_wiring(model.get_config())
    except Exception:  # noqa: BLE001 - a subclassed model: no wiring to compare
        wiring = []
    # Compared by the model inputs' positions (dict inputs come sorted by
    # key), not by their names: inputs created in another order (so named
    # otherwise) but passed in the same order feed the same data.
    position = {getattr(t, "name", None): k
                for k, t in enumerate(getattr(model, "inputs", None) or [])}
    key = [(name, sorted(str(position.get(i, i)) for i in fed)) for name, fed in wiring]
    # The same wiring without the inputs that only some pipelines have
    # (with_unique_ids' lookahead and eviction hints): told apart in the
    # message, since layer names are not the problem then (a review).
    kept = [i for i in position if not _is_vsi_extra(i)]
    core_position = {i: k for k, i in enumerate(sorted(kept, key=position.get))}
    core = [(name, sorted(str(core_position.get(i, i)) for i in fed if not _is_vsi_extra(i)))
            for name, fed in wiring]
    shown = [f"{name} <- " + ", ".join(
        f"input {position[i]} ({i})" if i in position else i for i in fed) for name, fed in wiring]
    # And each table's settings: a learning rate set otherwise on one rank
    # trained silently apart, another optimizer or output_dim failed in a
    # collective with a shape error (a review).
    settings = _table_settings(model, training=call == "fit")
    # 48 bits of a digest: exact in float64, so one max-reduction of (h, -h)
    # tells whether every rank has the same wiring.
    digest = float(int.from_bytes(hashlib.sha256(
        json.dumps([call, key, settings]).encode()).digest()[:6], "little"))
    hvd = require()
    most = hvd.allreduce(tf.constant([digest, -digest], tf.float64), op=hvd.Max,
                         name="sfctr_tables_wiring").numpy()
    if most[0] == -most[1]:
        return
    gathered = hvd.allgather_object((call, key, shown, settings, core),
                                    name="sfctr_tables_wiring_detail")
    calls, every = [g[0] for g in gathered], [g[1:] for g in gathered]
    rank = hvd.rank()
    if any(c != call for c in calls):
        raise ValueError(
            f"The Horovod ranks are in different Keras calls: this rank ({rank}) in "
            f"{call}, the ranks in {', '.join(f'{c} (rank {r})' for r, c in enumerate(calls))}"
            f". Each step of fit, evaluate and predict is collective (a table's ids and rows "
            f"go to their owners), so every rank must make the same call with as many "
            f"batches: call model.{call} on every rank, not on some only.")
    if all(k == key for k, _, _, _ in every):
        other = next(r for r, e in enumerate(every) if e[2] != settings)
        differ = [(mine, theirs) for mine, theirs in zip(settings, every[other][2])
                  if mine != theirs]
        if differ and len(differ[0][0]) == len(differ[0][1]) \
                and differ[0][0][0] == differ[0][1][0]:
            # One table, set otherwise: name it and the settings that differ.
            mine, theirs = differ[0]
            fields = [(a or "(not set)", b or "(not set)")
                      for a, b in zip(mine[1:], theirs[1:]) if a != b]
            if any("not built" in (a, b) for a, b in fields):
                where = "not on" if "not built" not in mine else "only on"
                raise ValueError(
                    f"The Horovod ranks' CachedEmbedding layers are built on some ranks only: "
                    f"table {mine[0]!r} is built {'on this rank' if where == 'not on' else 'not on this rank'} "
                    f"({rank}) and {'not ' if where == 'not on' else ''}on rank {other}. A model "
                    f"called (or a table used) before fit on some ranks only builds its tables "
                    f"there alone, and the ranks' steps would not pair up. Build it alike on "
                    f"every rank: call it on a batch on every rank, or on none (fit builds it).")
            shown_mine = f"table {mine[0]!r}: {', '.join(a for a, _ in fields)}"
            shown_theirs = ", ".join(b for _, b in fields)
        else:
            shown_mine, shown_theirs = settings, every[other][2]
        raise ValueError(
            f"The Horovod ranks' CachedEmbedding layers have different settings: on this "
            f"rank ({rank}) {shown_mine}; on rank {other} {shown_theirs}. Make every rank's "
            f"tables alike (output_dim, table optimizer and its learning rate, distribution, "
            f"combiner, embeddings_initializer, trainable, table_updates; a data-parallel "
            f"table's cache_capacity and max_rows).")
    other = next(r for r, (k, _, _, _) in enumerate(every) if k != key)
    differ = [line for line, pair in zip(shown, key) if pair not in every[other][0]]
    if all(c == core for _, _, _, c in every):
        raise ValueError(
            f"The Horovod ranks feed their CachedEmbedding layers different kinds of "
            f"de-duplicated inputs: on this rank ({rank}) {differ[:6]}, on rank {other} "
            f"{[line for line, pair in zip(every[other][1], every[other][0]) if pair not in key][:6]}"
            f". Give every rank the same tf_sfctr.data.with_unique_ids(...) settings "
            f"(lookahead, eviction_hints) and the same vsi_inputs(...) model inputs.")
    raise ValueError(
        f"The Horovod ranks' models wire their CachedEmbedding layers differently: on this "
        f"rank ({rank}) {differ[:6]}, on rank {other} "
        f"{[line for line, pair in zip(every[other][1], every[other][0]) if pair not in key][:6]}"
        f". Ranks pair a layer's collectives by its name, and Keras names layers in the order "
        f"they are created: give each CachedEmbedding its own name= (e.g. "
        f"name=f'emb_{{feature}}'), or create them in the same order on every rank (not by "
        f"iterating over a set).")


def _is_vsi_extra(input_name) -> bool:
    """A model input of with_unique_ids' optional keys (vsi_inputs names
    them '<feature>_<key>')."""
    from tf_sfctr.keras_layers._layer_inputs import VSI_OPTIONAL_KEYS

    return isinstance(input_name, str) and input_name.endswith(VSI_OPTIONAL_KEYS)


def _table_settings(model, training: bool) -> list:
    """What every rank's copy of each table must share, by layer name.
    ``training``: also whether it trains (a table frozen on one rank only
    ran inference there while the others trained it: each waited for the
    other's collectives, silently; a review)."""
    from tf_sfctr.callbacks import cached_embeddings

    return sorted(
        [layer.name, f"output_dim={layer.output_dim}", f"distribution={layer.distribution!r}",
         f"combiner={layer.combiner!r}",
         f"optimizer={type(layer.table_optimizer).__name__} " + json.dumps(
             layer.table_optimizer.get_config(), sort_keys=True, default=str),
         _update_count(layer),
         # What makes the rows (kind and its two numbers), not the Keras
         # initializer's config, whose own seed the layer's seed overrides.
         "embeddings_initializer={0.kind}({0.a!r}, {0.b!r})".format(layer._init_spec)]
        + ([f"trainable={bool(layer.trainable)}"] if training else [])
        for layer in cached_embeddings(model))


def _seeds(model) -> list:
    """The seeds of model-parallel tables (each owner makes the initial rows
    of its ids from its own): built ones', and explicit ones' before build
    (a drawn one is each rank's own until build replaces it with rank 0's).
    A data-parallel replica's is compared by _check_replicas_agree."""
    from tf_sfctr.callbacks import cached_embeddings

    seeds = []
    for layer in cached_embeddings(model):
        built = getattr(layer, "_store", None) is not None
        if layer.distribution == "data_parallel" or (built and layer.mode != "model_parallel") \
                or (not built and layer._seed_drawn):
            continue
        seeds.append((layer.name, int(layer.seed)))
    return sorted(seeds)


def _warn_of_seeds(model) -> None:
    """Collective (at fit): warns, on rank 0, of model-parallel tables whose
    seed differs between ranks. Not refused: the table trains, and a plain
    tf.train.Checkpoint restore of each rank's shard gives each rank the seed
    its shard was saved with (checkpoints of versions whose drawn seeds were
    each rank's own), which the user cannot change once built. But each
    owner's new ids start from its own seed's rows, so no other number of
    ranks reproduces the table (``seed=100 + rank``: a review)."""
    hvd = require()
    seeds = _seeds(model)
    digest = float(int.from_bytes(hashlib.sha256(
        json.dumps(seeds).encode()).digest()[:6], "little"))
    most = hvd.allreduce(tf.constant([digest, -digest], tf.float64), op=hvd.Max,
                         name="sfctr_tables_seeds").numpy()
    if most[0] == -most[1]:
        return
    every = hvd.allgather_object(seeds, name="sfctr_tables_seeds_detail")
    if hvd.rank() != 0:
        return
    names = sorted({name for ranks in every for name, _ in ranks})
    shown = []
    for name in names:
        per_rank = [dict(ranks).get(name) for ranks in every]
        if len(set(per_rank)) > 1:
            shown.append(f"{name!r} (" + ", ".join(
                f"rank {r}: {seed}" for r, seed in enumerate(per_rank)) + ")")
    warnings.warn(
        f"Model-parallel CachedEmbedding tables have a different seed on each Horovod rank: "
        f"{', '.join(shown)}. Each rank makes the initial rows of the ids it owns from its "
        f"own seed, so the table trains, but no other number of ranks (and no restore into "
        f"one) gives ids it has not stored the same rows. Give every rank the same seed= "
        f"(or none: rank 0's is used), or restore with tf_sfctr.distributed.restore, which "
        f"gives every rank the save's seed.", stacklevel=3)


def _update_count(layer) -> str:
    """A model-parallel table's update count (Adam's bias correction and a
    schedule count it on each owner: `table_updates` set on one rank only
    would train the shards apart). A data-parallel table's replicas are
    compared whole, with their own message, by _check_replicas_agree; here
    their cache_capacity and max_rows: each replica prepares every rank's
    ids, so one with less room than the others refuses a step they train,
    and they wait for it in the step's all-reduce (a model-parallel owner's
    refusal is told to every rank)."""
    if getattr(layer, "_store", None) is None:
        return "not built"
    if layer.mode == "data_parallel":
        return f"cache_capacity={layer.cache_capacity}, max_rows={layer.max_rows}"
    if layer.mode != "model_parallel":
        return ""
    return f"table_updates={layer.table_updates}"


class BroadcastInitialState(keras.callbacks.Callback):
    """Copies the dense weights and the optimizer state of ``root_rank`` to
    every rank before the first training step, so all replicas start equal.

    A subclassed model that is not built yet when ``fit`` starts has no
    weights to send: Keras builds it in its first step. Its state is then
    broadcast after that step, so the replicas are equal from the second
    step on, but the first step started from each rank's own weights. Call
    the model on one batch before ``fit`` to have them start equal too.

    Table rows are not broadcast: they are sharded (model parallel) or built
    identically from the layer's seed (data parallel). Data-parallel
    replicas that differ when the state is sent (a checkpoint or weight file
    loaded on one rank only, a prune on one rank) are refused on every rank,
    before the broadcast would hide it in the dense weights and the table's
    step count.

    The state is sent once per model: a later ``fit`` of the same model
    continues from equal replicas; the callback given to another model's
    ``fit`` sends that model's state.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        if isinstance(root_rank, (bool, np.bool_)) or not isinstance(
                root_rank, (int, np.integer)) or root_rank < 0:
            # (Horovod's own error at the first step named no root_rank.)
            raise ValueError(f"root_rank must be a rank, an integer >= 0, got {root_rank!r}")
        self.root_rank = int(root_rank)
        self._sent_for = None  # weak reference to the model whose state was sent
        # The model fit trains (an evaluate or predict run from a callback
        # with fit's callbacks list sets another as self.model).
        self._training = None

    def _done(self, model) -> bool:
        return self._sent_for is not None and self._sent_for() is model

    def _broadcast(self, model):
        hvd = require()
        _check_replicas_agree(model)  # before the broadcast hides a one-rank load
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        variables = [v.value if hasattr(v, "value") else v for v in model.variables]
        if model.optimizer is not None:
            variables += [v.value if hasattr(v, "value") else v
                          for v in model.optimizer.variables]
        hvd.broadcast_variables(variables, root_rank=self.root_rank)
        self._sent_for = weakref.ref(model)

    def on_train_begin(self, logs=None):
        self._training = weakref.ref(self.model)
        _warn_unless_averaging(self.model)
        # At every fit, not only before the first broadcast: a replica changed
        # on one rank between two fits with one callbacks() list (its
        # table_updates, say) trained apart silently (a review).
        # The tables (and the call) first: a rank in evaluate or predict meets
        # this one's first collective there.
        _check_same_tables(self.model, "fit")  # before the broadcast, which would hang
        _warn_of_seeds(self.model)
        # Built (with weights to send) on every rank, or else the state goes
        # after the first step on every rank: a model called on one rank
        # only before fit (to print its summary, say) broadcast there alone
        # and waited forever (a review).
        built, ready = _on_every_rank(
            self.model.built, bool(self.model.built and self.model.trainable_variables))
        if built:
            _check_replicas_agree(self.model)
        if self._done(self.model) or not ready:
            return  # not built yet everywhere: after the first step
        self._broadcast(self.model)

    def on_train_batch_end(self, batch, logs=None):
        model = self._training() if self._training is not None else self.model
        if not self._done(model):
            self._broadcast(model)

    def on_train_end(self, logs=None):
        self._training = None


def _on_every_rank(*flags: bool) -> tuple:
    """Collective: each flag, true only if it is true on every rank."""
    hvd = require()
    lowest = hvd.allreduce(tf.constant([1 if f else 0 for f in flags], tf.int32), op=hvd.Min,
                           name="sfctr_on_every_rank").numpy()
    return tuple(bool(v) for v in lowest)


def _check_replicas_agree(model) -> None:
    """Collective: refuses, on every rank, data-parallel tables whose
    replicas differ in their row count, update count or initializer seed.
    Their rows are never broadcast (each replica builds them from the seed
    and trains on every rank's ids), so a restore or ``load_weights`` on
    root only, Horovod's usual pattern for dense weights, left the other
    replicas at their fresh rows; the dense weights, the table's step and
    the predictions then disagreed, silently (a review)."""
    from tf_sfctr.callbacks import cached_embeddings

    hvd = require()
    mine = []
    for layer in cached_embeddings(model):
        if layer.mode != "data_parallel" or getattr(layer, "_store", None) is None:
            continue
        mine.append((layer.name, int(layer.cache_stats()["host_rows"]),
                     int(layer._table_step.numpy()), int(layer.seed)))
    every = hvd.allgather_object(mine, name="sfctr_replica_digests")
    if all(other == every[0] for other in every):
        return
    lines = []
    for k, entry in enumerate(every[0]):
        shown = [f"rank {r}: {e[k][1]} rows, {e[k][2]} updates, seed {e[k][3]}"
                 for r, e in enumerate(every) if k < len(e)]
        if len({e[k] for e in every if k < len(e)}) > 1:
            lines.append(f"{entry[0]!r} ({'; '.join(shown)})")
    raise ValueError(
        "The data-parallel CachedEmbedding replicas differ between the Horovod ranks: "
        + ", ".join(lines or ["(the ranks' models hold different tables)"]) + ". Their "
        "rows are not broadcast like the dense weights: every rank must restore the same "
        "checkpoint or load the same weights (tf_sfctr.distributed.restore or "
        "load_weights on every rank, not on rank 0 only), prune alike and set "
        "table_updates alike. Nothing was broadcast.")


def _warn_unless_averaging(model):
    hvd = require()
    opt = getattr(model, "optimizer", None)

    def averages(o):
        return getattr(type(o), "_sfctr_distributed", False)

    # DistributedOptimizer(LossScaleOptimizer(...)) averages; so would the
    # reverse order (which the layer refuses, see _loss_scale).
    if not averages(opt) and isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer
    if hvd.size() > 1 and opt is not None and not averages(opt):
        warnings.warn(
            f"The model's optimizer ({type(opt).__name__}) does not average gradients over "
            f"the {hvd.size()} Horovod ranks: each rank's dense weights would follow its own "
            "batches and the replicas drift apart (the tables stay shared). Compile with "
            "tf_sfctr.distributed.DistributedOptimizer(optimizer).")


#: Keras metrics whose state variables are sums over examples (counts,
#: totals, confusion-matrix cells), so that the sum of every rank's state is
#: the state of one process that saw all the examples. Keras's own classes
#: only: a subclass may keep other state.
_ADDITIVE_METRICS = (
    keras.metrics.Mean, keras.metrics.Sum, keras.metrics.AUC, keras.metrics.Precision,
    keras.metrics.Recall, keras.metrics.TruePositives, keras.metrics.TrueNegatives,
    keras.metrics.FalsePositives, keras.metrics.FalseNegatives,
    keras.metrics.PrecisionAtRecall, keras.metrics.RecallAtPrecision,
    keras.metrics.SensitivityAtSpecificity, keras.metrics.SpecificityAtSensitivity)


def _leaf_metrics(metrics) -> list:
    leaves = []
    for m in metrics:
        inner = getattr(m, "metrics", None)  # Keras's containers of compiled metrics
        if isinstance(inner, (list, tuple)):
            leaves.extend(_leaf_metrics(inner))
        else:
            leaves.append(m)
    return leaves


def _additive(metric) -> bool:
    return (isinstance(metric, _ADDITIVE_METRICS)
            and type(metric).__module__.split(".")[0] == "keras")


class AverageMetrics(keras.callbacks.Callback):
    """Makes every rank log the same metrics at the end of an epoch (and of
    evaluation): the values of one process that saw every rank's examples.

    When all the model's metrics are Keras metrics whose state is a sum over
    examples (the loss, ``Mean``-based metrics such as accuracy, ``AUC``,
    ``Precision``, ``Recall`` and the other confusion-matrix metrics), the
    ranks sum their metric states (one all-reduce) and each computes the
    results from the sums: the global loss, accuracy and AUC, also when ranks
    had different numbers of examples. Otherwise (a custom metric) each
    logged value becomes its mean over ranks, which is the global value for
    means over examples only when every rank had as many.

    Put it before the callbacks that read metrics (``EarlyStopping``,
    ``ReduceLROnPlateau``, ``ModelCheckpoint(save_best_only=True)``), so they
    decide on the averaged values. At the end of each epoch the ranks also
    agree on stopping: if any rank's ``model.stop_training`` is set (by a
    callback that ran before this one, on its own rank's metrics), every rank
    stops; a rank stopping alone would leave the others waiting in their next
    step's collectives. A learning rate that differs between ranks then (set
    by such a callback) raises on every rank, as the replicas would drift
    apart. A stop requested at the end of a batch (``TerminateOnNaN``) is
    not agreed on: it ends the epoch on that rank only.

    Every rank must run as many steps. When ``fit``, ``evaluate`` or
    ``predict`` starts and Keras knows each rank's number of batches (arrays,
    datasets of known cardinality, ``steps_per_epoch``), ranks with different
    numbers raise on every rank before the first step (and before each of
    ``fit``'s validations, for the validation batches), as do ranks of which
    some know the number and others do not, and ranks given different numbers
    of epochs. A rank whose data ends before the steps Keras expected (Keras
    only warns "Your input ran out of data"), or that ran no training step in
    an epoch, raises at the end of that epoch, evaluation or prediction,
    before any collective; ``horovodrun`` then ends the job. (Other ranks
    would wait in their steps forever.) At the end of each epoch the ranks
    also compare the optimizer's iteration counts, and raise on every rank
    when they differ.
    """

    def __init__(self):
        super().__init__()
        self._in_fit = False
        self._trained = False
        self._epochs_checked = False
        # fit's params: an evaluate or predict run from a callback with the
        # same callbacks list replaces self.params with its own meanwhile.
        self._fit_params = None
        self._validating = False
        # Steps run in this epoch / evaluation / prediction, and how many
        # Keras said it would run (None: not known).
        self._train_done = 0
        self._test_done, self._test_steps = 0, None
        self._predict_done, self._predict_steps = 0, None
        # The epoch's global training results, taken before validation.
        self._train_results, self._train_results_taken = None, False

    def _global_results(self):
        """The model's metric results from every rank's summed states (the
        states are left as they were), or None when a metric's state is not
        a sum over examples. Collective when not None: every rank compiled
        the same metrics, so every rank takes the same branch."""
        model = self.model
        leaves = _leaf_metrics(getattr(model, "metrics", []))
        if not leaves or not all(_additive(m) for m in leaves):
            return None
        variables = [v for m in leaves for v in m.variables]
        local = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
        flat = np.concatenate([x.astype(np.float64).ravel() for x in local] + [np.zeros(0)])
        hvd = require()
        summed = hvd.allreduce(tf.constant(flat), op=hvd.Sum,
                               name="sfctr_metric_states").numpy()
        try:
            start = 0
            for v, x in zip(variables, local):
                part = summed[start:start + x.size].reshape(x.shape)
                start += x.size
                v.assign(part.astype(x.dtype))
            return model.get_metrics_result()
        finally:
            for v, x in zip(variables, local):
                v.assign(x)

    def _globalize(self, logs, results):
        """Sets the logged values that ``results`` (or None) has; averages
        the other scalar ones over ranks."""
        if not logs:
            return
        rest = {}
        for key, value in logs.items():
            if results is not None and key in results:
                logs[key] = float(results[key])
            elif np.ndim(value) == 0:
                rest[key] = value
        self._average(rest)
        logs.update(rest)

    def _check_steps(self, call, steps, unit="steps"):
        """Collective: raises on every rank when the ranks would run
        different numbers of steps (None: not known on this rank), or of
        ``unit``."""
        hvd = require()
        mine = -1.0 if steps is None else float(steps)  # -1: not known here
        most = hvd.allreduce(tf.constant([mine, -mine], tf.float64), op=hvd.Max,
                             name="sfctr_steps").numpy()
        largest, smallest = most[0], -most[1]
        if smallest < 0 <= largest:
            raise ValueError(
                f"{call}: Keras knows the number of batches on some of the {hvd.size()} "
                f"Horovod ranks ({int(largest)}) but not on others (data of unknown size, "
                f"e.g. after filter() or from files; this rank: "
                f"{'unknown' if mine < 0 else int(mine)}). The ranks could run different "
                "numbers of steps, and Keras counts one more optimizer iteration after an "
                "epoch over data of unknown size, so the ranks' optimizers would drift apart. "
                "Give every rank as many batches of the same kind: steps_per_epoch (or "
                "steps=) with dataset.repeat() on every rank, or dataset.take(n) on every "
                "rank.")
        if smallest >= 0 and largest != smallest:
            fix = ("Give every rank the same epochs and initial_epoch." if unit == "epochs" else
                   "Give every rank as many batches: steps_per_epoch (or steps=) with "
                   "dataset.repeat(), or dataset.take(n) on every rank.")
            raise ValueError(
                f"{call} would run {int(smallest)} to {int(largest)} {unit} on the "
                f"{hvd.size()} Horovod ranks (this rank: {int(mine)}); every rank must run as "
                f"many (each step is collective: the ranks with more would wait forever). {fix}")

    def _params_steps(self):
        return (self.params or {}).get("steps")

    def _steps_after(self, batch):
        """Steps run once the batch (or execution) starting at ``batch`` is
        done: Keras reports the first step of each execution of
        ``steps_per_execution`` steps when it knows the count."""
        per = int(getattr(self.model, "steps_per_execution", 1) or 1)
        return batch + per

    def _fit_steps(self):
        return (self._fit_params or {}).get("steps")

    def _check_ran(self, call, done, steps, stop_ok=False, partial_reported=False):
        """Local, before any collective: raises when this rank's data ended
        before the ``steps`` Keras said it would run (Keras only warns "Your
        input ran out of data"). The other ranks wait in their next step, so
        a collective here would wait forever; raising ends the job.
        ``stop_ok``: a callback ended the call early (``stop_training``,
        ``stop_evaluating``, ``stop_predicting``; not agreed on between
        ranks: see above)."""
        # With steps_per_execution, an execution that data ran out of is not
        # reported: Keras 3.5 runs a last partial one of steps % per, which
        # fails when the data ends (after its steps ran), warns, and ends the
        # epoch as expected. Only the full executions are certain.
        if steps is None or stop_ok:
            return
        per = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if done >= (steps if per == 1 or partial_reported else steps - steps % per):
            return
        raise ValueError(
            f"This Horovod rank ({require().rank()}) ran {done} of the {steps} steps of "
            f"{call}: its data ended first (Keras warned \"Your input ran out of data\"). "
            "Under Horovod every rank must run as many steps (each step is collective, and "
            "ranks with data left wait in theirs), so this is an error even if every "
            "rank's data ended alike. Give every rank enough batches: dataset.repeat() "
            "with steps_per_epoch (or steps= / validation_steps=), or dataset.take(n) on "
            "every rank.")

    def set_params(self, params):
        # Keras sets a call's params and model on every callback of its list
        # before the call begins; what they were is set back when an
        # evaluate or predict run from a callback with this list ends.
        self._params_before = getattr(self, "params", None)
        super().set_params(params)

    def set_model(self, model):
        self._model_before = getattr(self, "_model", None)
        super().set_model(model)

    def on_train_begin(self, logs=None):
        # (A fit run from a callback needs a callbacks() list of its own:
        # README. A fit that raised never ended, so being in one cannot
        # tell a nested fit apart.)
        self._in_fit = True
        self._epochs_checked = False
        self._fit_params = self.params
        self._check_steps("fit", self._fit_steps())

    def _note_caller(self):
        """At the start of an evaluate or predict: the params and model to
        set back at its end."""
        self._caller = (self._params_before, self._model_before)

    def _back_to_caller(self):
        """After an evaluate or predict, which set its params and model on
        every callback of its list: the ones before it, when it ran from a
        callback of a fit or evaluate with this list (its later validations
        were taken for evaluates, its training logs read from the other
        call's metrics, its step count taken for fit's)."""
        params, model = getattr(self, "_caller", (None, None))
        if params is not None:
            super().set_params(params)
        if model is not None:
            super().set_model(model)

    def on_train_end(self, logs=None):
        if not self._epochs_checked:
            # No epoch ran here (initial_epoch >= epochs): the other ranks'
            # first epoch asks how many epochs every rank runs.
            self._check_epochs(0)
        self._in_fit = False
        self._fit_params = None

    def _check_epochs(self, left):
        """Collective, at fit's first epoch (or its end when it ran none)."""
        self._epochs_checked = True
        self._check_steps("fit (epochs - initial_epoch)", left, unit="epochs")

    def on_test_begin(self, logs=None):
        self._test_done = 0
        # fit's validation runs with fit's callbacks list, and so fit's params
        # (an evaluate run from a callback with this list sets its own).
        self._validating = self._in_fit and self.params is self._fit_params
        if not self._validating:
            self._note_caller()
            _check_same_tables(self.model, "evaluate")
            self._test_steps = self._params_steps()
            self._check_steps("evaluate", self._test_steps)
        else:
            self._check_ran("fit's epoch", self._train_done, self._fit_steps(),
                            stop_ok=getattr(self.model, "stop_training", False))
            # The epoch's training states, before validation resets them.
            self._train_results = self._global_results()
            self._train_results_taken = True
            # fit's params count training steps only: a rank with more
            # validation batches waited forever in its extra one (found by
            # a review). Keras keeps fit's validation data in this iterator
            # (None when Keras does not know the count).
            # Only a count Keras was given: after a first pass over data of
            # unknown size it guesses one (num_batches), one too many.
            validation = getattr(self.model, "_eval_epoch_iterator", None)
            self._test_steps = (
                getattr(validation, "steps_per_epoch", None)
                or getattr(getattr(validation, "data_adapter", None), "num_batches", None))
            self._check_steps("fit's validation", steps=self._test_steps)

    def on_test_batch_end(self, batch, logs=None):
        self._test_done = self._steps_after(batch)

    def on_predict_begin(self, logs=None):
        self._note_caller()
        _check_same_tables(self.model, "predict")
        self._predict_done, self._predict_steps = 0, self._params_steps()
        self._check_steps("predict", self._predict_steps)

    def on_predict_batch_end(self, batch, logs=None):
        self._predict_done = self._steps_after(batch)

    def on_predict_end(self, logs=None):
        # predict has no collective of its own at its end: without this,
        # the rank returned fewer predictions and the others waited. (Keras
        # reports predict's last, partial execution, unlike fit's.)
        self._check_ran("predict", self._predict_done, self._predict_steps,
                        partial_reported=True,
                        stop_ok=getattr(self.model, "stop_predicting", False))
        self._back_to_caller()

    def on_epoch_begin(self, epoch, logs=None):
        self._trained = False
        self._train_done = 0
        self._train_results, self._train_results_taken = None, False
        if not self._epochs_checked:
            # fit's epochs left (epochs - initial_epoch, known only now, as
            # BackupAndRestore may set it): a rank that finished first waited
            # in its next collective.
            epochs = (self._fit_params or {}).get("epochs")
            self._check_epochs(None if epochs is None else epochs - epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._trained = True
        self._train_done = self._steps_after(batch)

    def _average(self, logs):
        if not logs:
            return
        hvd = require()
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="sfctr_metrics").numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)

    def on_epoch_end(self, epoch, logs=None):
        per = int(getattr(self.model, "steps_per_execution", 1) or 1)
        steps = self._fit_steps()
        # Keras reports no batch of an epoch shorter than one execution of
        # steps_per_execution (its only, partial execution): only with a
        # count of at least one execution is "no batch" "no step".
        if not self._trained and (per == 1 or (steps is not None and steps >= per)):
            # Before any collective: the others are waiting in a step.
            raise ValueError(
                f"This Horovod rank ({require().rank()}) ran no training step in epoch "
                f"{epoch + 1}: its data ended. Every rank must run as many steps (each step is "
                "collective); give every rank as many batches: steps_per_epoch with "
                "dataset.repeat(), or dataset.take(n) on every rank.")
        if not self._train_results_taken:  # (else checked when validation began)
            self._check_ran("fit's epoch", self._train_done, self._fit_steps(),
                            stop_ok=getattr(self.model, "stop_training", False))
        results = (self._train_results if self._train_results_taken
                   else self._global_results())
        # Validation results (val_...) were made global when they were
        # logged (on_test_end); the training ones here.
        train = {k: v for k, v in (logs or {}).items() if not k.startswith("val_")}
        self._globalize(train, results)
        if logs is not None:
            logs.update(train)
        self._agree()

    def _agree(self):
        hvd = require()
        model = self.model
        stop = 1.0 if getattr(model, "stop_training", False) else 0.0
        lr = it = 0.0
        if getattr(model, "optimizer", None) is not None:
            from tf_sfctr.callbacks import _Steps

            lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
            # (A LossScaleOptimizer's own count never moves: its inner one's.)
            it = float(_Steps._iterations(model) or 0)
        # One max-reduction: any rank stopping, and the largest and smallest
        # rate and optimizer iteration count.
        most = hvd.allreduce(tf.constant([stop, lr, -lr, it, -it], tf.float64), op=hvd.Max,
                             name="sfctr_epoch_end").numpy()
        if most[0] > 0:
            model.stop_training = True
        if most[3] != -most[4]:
            raise ValueError(
                f"The optimizer's iteration count differs between Horovod ranks at the end of "
                f"this epoch (from {int(-most[4])} to {int(most[3])}; this rank: {int(it)}), "
                "so its steps (Adam's bias correction, learning-rate schedules) differ too and "
                "the replicas would drift apart. Keras counts one more iteration after an "
                "epoch over data of unknown size; give every rank as many batches of the same "
                "kind (steps_per_epoch with dataset.repeat(), or dataset.take(n)).")
        if most[1] != -most[2]:
            raise ValueError(
                f"The learning rate differs between Horovod ranks at the end of this epoch "
                f"(from {-most[2]:g} to {most[1]:g}; this rank: {lr:g}): a callback that ran "
                "before tf_sfctr.distributed.callbacks() (e.g. ReduceLROnPlateau) changed it "
                "from this rank's own metrics, and the replicas would drift apart. Put "
                "tf_sfctr.distributed.callbacks() first in the callbacks list.")

    def on_test_end(self, logs=None):
        # Not fit's validation: given validation_steps over finite data,
        # Keras 3.5 shortens the validation the data runs out in and skips
        # the later ones (with a warning), on every rank alike.
        if not self._validating:
            self._check_ran("evaluate", self._test_done, self._test_steps,
                            stop_ok=getattr(self.model, "stop_evaluating", False))
        self._globalize(logs, self._global_results())
        if not self._validating:
            self._back_to_caller()


def callbacks(root_rank: int = 0) -> list[keras.callbacks.Callback]:
    """The callbacks a Horovod ``model.fit`` needs: broadcast the initial state
    from ``root_rank`` and average metrics over ranks. Put them before the
    callbacks that act on metrics (see ``AverageMetrics``), and pass them to
    ``evaluate`` too for averaged results.

    Example::

        model.fit(ds, steps_per_epoch=steps,  # the same on every rank
                  callbacks=[*tf_sfctr.distributed.callbacks(),
                             keras.callbacks.EarlyStopping(monitor="loss", patience=2)])
    """
    return [BroadcastInitialState(root_rank), AverageMetrics()]
