"""The one training loop: any objective, one worker or many.

``train(config, env)`` is the per-worker function.  Everything that differs between running in
this process and running as a Ray Train worker -- the collective, the device, where checkpoints
and reports go -- comes in through ``env`` (see ``dpsm_ray.train.env``), so the maths here is the
same with world size 1 and is testable without Ray.

Data order (the paper's Algorithm 1; docs/method.md): the training split is cut once, at random, into halves D1 and D2
(Algorithm 1, line 3).  Each epoch draws one global permutation of each half from the run seed;
global step i takes the i-th ``batch_size / 2`` block of each, and worker r its contiguous
``1 / W`` slice.  No sampler padding; a last partial block is dropped on every worker alike.
An objective whose ``batch_split`` is ``"batch"`` (ConfTr's default, ConfTr as published, DPSM with
``dpsm_split="batch"``) instead gets each ``batch_size`` block of a permutation of the whole
training split cut into its two halves (Stutz et al.'s random calibration/prediction split).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from dpsm_ray.conformal import (
    empirical_quantile,
    Resplits,
    evaluate,
    evaluate_classes,
    label_scores,
    pinball_loss,
    prediction_sets,
    set_size,
    soft_set_size,
)
from dpsm_ray.cards import build_model, load_splits, score_functions
from dpsm_ray.data import DataSplits, Split, stratified_partition
from dpsm_ray.cards import method_fields
from dpsm_ray.models.weights import load_weights
from dpsm_ray.cards import build_objective
from dpsm_ray.objectives import STAT_COLUMNS, Objective, hps_scores
from dpsm_ray.storage.schema import EPOCHS, RUN_KEY
from dpsm_ray.seeding import derive_seed, generator
from dpsm_ray.config import WEIGHTS, ConfigError, TrainConfig
from dpsm_ray.train.lines import EpochLine
from dpsm_ray.train.step import Forwards, GraphStep, auto_line, build_step, forward_objective, graph_capturable, resolve_channels_last

# Examples per forward pass in eval mode.  On the CPU a chunk's logits do not depend on its size, down to 8
# examples (tests/train/test_loop.py; a last chunk of 1 or 2 takes another kernel, a last bit apart), so this is
# speed alone: on one thread a LeNet forward of 256 images keeps its activations near the cache, and scores
# fonts' 13536 training images in 4.3 s against 9.2 s in chunks of 512 (bench/eval_batch.py)
EVAL_BATCH = 256
T = TypeVar("T")
# The epoch's wall time and its parts: the columns of epochs.parquet that differ between two runs of
# the same configuration.
EPOCH_TIMINGS = ("epoch_seconds", "train_seconds", "diagnostics_seconds", "validation_seconds")
# Per-epoch columns of epochs.parquet, in order: the schema's (docs/results.md), without the run's key.
EPOCH_COLUMNS = tuple(name for name in EPOCHS if name not in RUN_KEY)
# Elements of the largest [thresholds, n, K] block the diagnostics evaluate at once.
_DIAGNOSTIC_BLOCK = 2**24
# ConfTr's batch quantiles the diagnostics average over: a seeded sample of this many calibration
# batches (all 859 of a 55k split at batch 128 cost 21 s an epoch on 2 cores, 11x the training)
_DIAGNOSTIC_BATCHES = 64


class DivergedError(RuntimeError):
    """The training loss became NaN or infinite."""


@dataclass
class RunResult:
    """What a finished run hands back: one row per epoch, the final evaluation rows, and the
    final model's per-class rows (one per score, re-split and class)."""

    config: TrainConfig
    epochs: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    classes: list[dict] = field(default_factory=list)
    split_sizes: dict[str, int] = field(default_factory=dict)
    split_ids: dict[str, list[int]] = field(default_factory=dict)
    model_state: dict[str, torch.Tensor] = field(default_factory=dict)
    device: str | None = None  # where it trained, and torch's threads there (config.json's runtime record)
    torch_threads: int | None = None


def load_data(config: TrainConfig, device: torch.device) -> DataSplits:
    data = load_splits(
        config.dataset, config.data_root, seed=config.data_seed(), download=config.download, data_workers=config.data_workers
    )
    if config.train_subset is not None:
        if config.train_subset > len(data.train):
            raise ConfigError("train_subset", config.train_subset, f"must be at most the {len(data.train)} training examples found on disk")
        keep = stratified_partition(data.train.labels, [config.train_subset], derive_seed(config.data_seed(), "subset"))[0]
        data.train = data.train.subset(keep)
    return data.to(device)


def halves(train_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """D1 and D2: a random, fixed split of the training positions into equal halves."""
    order = torch.randperm(train_size, generator=generator(seed, "halves"))
    half = train_size // 2
    return order[:half], order[half : 2 * half]


def step_batches(half: torch.Tensor, epoch: int, seed: int, name: str, global_batch: int, rank: int, world: int) -> list[torch.Tensor]:
    """This worker's slices of the epoch's global batches from one half."""
    order = half[torch.randperm(half.numel(), generator=generator(seed, name, epoch))]
    local = global_batch // world
    steps = half.numel() // global_batch
    return [order[i * global_batch + rank * local : i * global_batch + (rank + 1) * local] for i in range(steps)]


def split_batches(
    pool: torch.Tensor, epoch: int, seed: int, batch_size: int, rank: int, world: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """ConfTr's batch split: each global batch is a random ``batch_size`` block of ``pool``, its
    first half B1 (calibration) and its second half B2 (prediction); this worker's slice of each."""
    order = pool[torch.randperm(pool.numel(), generator=generator(seed, "batch", epoch))]
    steps, half = pool.numel() // batch_size, batch_size // 2
    blocks = order[: steps * batch_size].reshape(steps, 2, half)[:, :, rank * (half // world) : (rank + 1) * (half // world)]
    return list(blocks[:, 0]), list(blocks[:, 1])


def _exponential_factor(epoch: int, start: int, decay: float) -> float:
    """The exp schedule's lr factor in 0-based ``epoch``: one ``decay`` per epoch from epoch ``start`` on."""
    return decay ** max(0, epoch - start + 1)


def lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig):
    """``step``: the lr times ``lr_decay`` at each milestone (MultiStepLR).  ``exp``: times
    ``lr_decay`` after every epoch from the first milestone on (from the first epoch without
    milestones) -- the other reading of the paper's decay column, under which iNaturalist's
    milestone 3 and factor 0.97 decay the lr to 0.97^57 = 0.18 of its start over 60 epochs instead
    of to 0.97 once."""
    if config.lr_schedule == "step":
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(config.milestones), gamma=config.lr_decay)
    start = config.milestones[0] if config.milestones else 1
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_exponential_factor, start=start, decay=config.lr_decay))


def _shard(n: int, rank: int, world: int) -> tuple[torch.Tensor, list[int]]:
    """Contiguous shard of ``range(n)`` for ``rank`` and the sizes of all shards (no padding)."""
    parts = torch.arange(n).tensor_split(world)
    return parts[rank], [p.numel() for p in parts]


def _run_to_end(run: Generator[None, None, T]) -> T:
    """What a generator of this module (``training``, ``predicting``, ...) returns, once it has run to its end."""
    while True:
        try:
            next(run)
        except StopIteration as done:
            return done.value


def _driven(generator: Callable[..., Generator[None, None, T]]) -> Callable[..., T]:
    """The function that runs ``generator`` (``predicting``, ...) to its end and returns its value:
    what one run calls, where a trial group's members run the generators in turns."""

    @functools.wraps(generator)
    def driven(*args, **kwargs) -> T:
        return _run_to_end(generator(*args, **kwargs))

    return driven


@torch.no_grad()  # on a generator: only while it runs, never across its yields (a group's other members step then)
def predicting(model, split: Split, positions, num_classes: int, env, precision: str = "fp32", forwards: Forwards | None = None):
    """Logits of ``split[positions]`` in eval mode (fp32 logits of a ``precision`` forward, run by
    ``forwards``: eagerly by default), computed in shards over the workers and gathered so every
    position appears exactly once, in order.  Yields after each batch: a trial group's members
    evaluate in turns, as they step."""
    mine, sizes = _shard(positions.numel(), env.collective.rank, env.collective.world_size)
    was_training = model.training
    model.eval()
    forwards = forwards or Forwards(precision)
    local = []
    try:
        # the bare module: DDP's forward would sync buffers, a collective that uneven shards deadlock
        for x, _ in split.batches(list(positions[mine].split(EVAL_BATCH)), augment=False, seed=0):
            local.append(forwards(unwrap(model), x.to(env.device, non_blocking=True)))
            yield
    finally:
        model.train(was_training)
    local = torch.cat(local) if local else torch.empty(0, num_classes, device=env.device)
    return env.collective.gather_uneven(local, sizes)


predict = _driven(predicting)


def _label_scores_of(
    model: nn.Module, split: Split, positions: torch.Tensor, num_classes: int, env, precision: str = "fp32"
) -> torch.Tensor:
    """HPS scores of the true labels of ``split[positions]`` (eval mode, every worker's shard)."""
    logits = predict(model, split, positions, num_classes, env, precision)
    return label_scores(hps_scores(logits), split.labels[positions].to(logits.device))


def train(config: TrainConfig, env) -> RunResult:
    """Train one model with ``config.method`` and evaluate it; see the module docstring."""
    return _run_to_end(training(config, env))


def training(config: TrainConfig, env) -> Generator[None, None, RunResult]:
    """``train``, one training step at a time: the generator yields after every step and returns
    the ``RunResult``.  Nothing else differs, so a trial group (``dpsm_ray.train.group``) can hand
    the process to its next member between two steps and each member computes what it would alone."""
    torch.manual_seed(derive_seed(config.seed, "init"))
    clock = env.clock  # where the run's time goes (dpsm_ray.timing): parts outside the epochs' own
    with clock("load_data"):
        data = load_data(config, env.device)
    build_started = time.perf_counter()  # "build": the model, objective, optimizer, and the checkpoint or q_0
    train_size = len(data.train)
    if config.batch_size > 2 * (train_size // 2):
        raise ConfigError("batch_size", config.batch_size, f"must be at most {2 * (train_size // 2)}, the training split")
    model = _starting_model(config, data)
    fields = {name: getattr(config, name) for name in ("alpha", *method_fields())}
    fields["quantile_lr"] = config.resolved_quantile_lr(train_size)  # gamma per step
    objective = build_objective(config.method, seed=config.seed, collective=env.collective, **fields)
    objective.attach(model, data.input_shape)  # what trains: every weight, or (ConfTS) a temperature in the frozen model
    graph_ok = graph_capturable(objective, config.nesterov)  # what --step auto may capture
    if (line := auto_line(config.step, config.precision, env.device, graph_ok)) is not None:
        env.log(line)
    channels_last = resolve_channels_last(config.step, config.channels_last, env.device, graph_ok)
    model = model.to(env.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # only 4-d (conv) weights change
    model = env.prepare_model(model)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay, nesterov=config.nesterov
    )
    # the step is built from the first batch (a captured step needs its shapes)
    make_step = functools.partial(
        build_step,
        model,
        objective,
        optimizer,
        kind=config.step,
        precision=config.precision,
        channels_last=channels_last,
        capturable=graph_ok,
    )
    scheduler = lr_scheduler(optimizer, config)
    d1, d2 = halves(train_size, config.seed)
    result = RunResult(
        config,
        split_sizes=data.sizes(),
        split_ids={n: getattr(data, n).ids.tolist() for n in ("train", "val", "cal", "test")},
        device=str(env.device),
        torch_threads=torch.get_num_threads(),
    )

    parts = (model, optimizer, scheduler, objective)
    start_epoch = _resumed_or_started(config, env, parts, data, d1, result)
    clock.add("build", time.perf_counter() - build_started)

    step = None
    forwards = Forwards(config.precision)  # captured once the steps are (below)
    for epoch in range(start_epoch, config.epochs):
        probed = time.perf_counter()
        with clock("evaluate"):  # before the epoch's first step: epoch 1's is the first step's gradient
            gradients = term_gradient_norms(model, objective, data.train, d1, d2, epoch, config, env, channels_last)
        started = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        with clock("train"):
            stats, step = yield from train_epoch(model, objective, data.train, d1, d2, epoch, config, env, make_step, step)
            _sync_buffers(model, env.collective)
            with warnings.catch_warnings():
                if isinstance(step, GraphStep):  # it updates the weights itself, reading the lr every batch
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
                scheduler.step()
        trained = time.perf_counter()  # the epoch's statistics are Python floats: the steps have finished
        forwards.capture = isinstance(step, GraphStep) and step.graph is not None
        row = {"epoch": epoch + 1, "lr": lr, "quantile_lr": objective.quantile_lr, **stats, **gradients}
        with clock("evaluate"):
            # each yields after every batch, as the steps do: a trial group's members take turns through their epochs' ends too
            row.update((yield from _diagnosing(model, objective, data, d1, d2, config, env, forwards)))
            row.update((yield from _train_mode_scoring(model, objective, data.train, d1, epoch, config, env, forwards)))
            diagnosed = time.perf_counter()
            row.update((yield from validating(model, data.val, data.num_classes, config, env, forwards)))
        ended = time.perf_counter()
        row.update(
            epoch_seconds=ended - probed,
            train_seconds=trained - started,
            diagnostics_seconds=diagnosed - trained + started - probed,
            validation_seconds=ended - diagnosed,
        )
        result.epochs.append(row)
        last = epoch == config.epochs - 1
        checkpoint = _checkpoint_of(epoch, config, env, parts, result) if last or (epoch + 1) % config.checkpoint_every == 0 else None
        env.log(_progress_line(row, config, objective.uses_quantile))
        with clock("report"):  # the checkpoint, the epoch rows and Ray's report
            env.report(row, checkpoint, result.epochs)

    if config.evaluate_test:
        with clock("final_evaluation"):
            result.evals, result.classes = yield from _evaluating(model, data, config, env, forwards)
    result.model_state = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    return result


def _starting_model(config: TrainConfig, data) -> torch.nn.Module:
    """The run's model on the CPU with its starting weights: the pretrained backbone it is built
    with, then the base model's weights (``init`` base) or a researcher's (``init`` weights:FILE)."""
    model = build_model(config.resolved_model(), data.num_classes, input_shape=data.input_shape, pretrained_path=config.pretrained_path)
    if config.init == "base":
        if config.init_checkpoint is None:
            raise RuntimeError("init='base' needs the base model's weights: run through run_training, which resolves the cache")
        model.load_state_dict(torch.load(config.init_checkpoint, map_location="cpu", weights_only=True))
    elif config.init.startswith(WEIGHTS):
        load_weights(model, config.init.removeprefix(WEIGHTS), config.model)
    return model


def _resumed_or_started(config: TrainConfig, env, parts: tuple, data, d1: torch.Tensor, result: RunResult) -> int:
    """The epoch the run starts at: after its checkpoint's, whose state ``parts`` (model, optimizer,
    scheduler, objective), the RNG streams and ``result``'s epochs take; else 0, the objective's
    state initialised from the starting model's scores."""
    model, optimizer, scheduler, objective = parts
    state = env.load_state()
    if state is not None:
        if state["config_hash"] != config.config_hash():
            raise RuntimeError("the checkpoint belongs to a different configuration; refusing to resume from it")
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        objective.load_state_dict(state["objective"])
        _set_global_rng_state(state["rng"], env.device)
        result.epochs = state["epochs"]
        env.log(f"resumed from the checkpoint after epoch {state['epoch'] + 1}")
        return state["epoch"] + 1
    # the starting model's scores of what B1 is drawn from (D1, or the whole training split),
    # in eval mode without augmentation: q_0 = their Q_n by default
    train_size = len(data.train)
    q_pool = d1 if objective.batch_split == "halves" else torch.arange(train_size)
    d1_scores = _label_scores_of(model, data.train, q_pool, data.num_classes, env, config.precision)
    objective.initialize(d1_scores)
    start = objective.start_line(d1_scores)
    if start is not None:
        env.log(f"[{config.method}] {start}, {config.steps_per_epoch(train_size)} steps per epoch")
    return 0


def _checkpoint_of(epoch: int, config: TrainConfig, env, parts: tuple, result: RunResult) -> dict:
    """What resumes the run after ``epoch``: the state of ``parts`` (model, optimizer, scheduler,
    objective), the RNG streams and the epochs' rows so far."""
    model, optimizer, scheduler, objective = parts
    return {
        "epoch": epoch,
        "config_hash": config.config_hash(),
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "objective": objective.state_dict(),
        "rng": _global_rng_state(env.device),
        "epochs": result.epochs,
    }


def _global_rng_state(device: torch.device) -> dict:
    """torch's global RNG streams (CPU, and this worker's GPU).  Data order and augmentation never
    draw from them, but a model's own randomness (dropout) does: a resumed run restores them so it
    continues exactly where the interrupted one stopped."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_global_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _sync_buffers(model: nn.Module, collective) -> None:
    """Give every worker rank 0's buffers (BatchNorm running statistics).

    DDP copies rank 0's buffers to the others at the start of each training forward, but the last
    step of an epoch then updates them from each worker's own batch.  Evaluation gathers logits
    from every worker's shard, so without this the shards would be scored by W slightly different
    models; with it they are all scored by the model rank 0 checkpoints."""
    if collective.world_size > 1:
        for buffer in unwrap(model).buffers():
            collective.broadcast_(buffer.data)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def _epoch_batches(objective: Objective, train_size: int, d1, d2, epoch: int, config: TrainConfig, rank: int, world: int):
    """The epoch's B1 and B2 positions, step by step (this worker's slices), and the seed of their
    augmentation: the halves D1 and D2, or ConfTr's batch split of the whole training split."""
    if objective.batch_split == "batch":
        batches1, batches2 = split_batches(torch.arange(train_size), epoch, config.seed, config.batch_size, rank, world)
    else:
        batches1 = step_batches(d1, epoch, config.seed, "d1", config.batch_size // 2, rank, world)
        batches2 = step_batches(d2, epoch, config.seed, "d2", config.batch_size // 2, rank, world)
    return batches1, batches2, derive_seed(config.seed, "augment", epoch)


def train_epoch(
    model, objective: Objective, train_split: Split, d1, d2, epoch: int, config: TrainConfig, env, make_step, step=None
) -> Generator[None, None, tuple[dict, object]]:
    """One epoch of steps, yielding after each; returns its mean statistics and the step function
    (reused by the next epoch; ``make_step(first_batch)`` builds it when ``step`` is None)."""
    rank, world = env.collective.rank, env.collective.world_size
    global_half = config.batch_size // 2
    if global_half % world:  # config.workers is checked up front; this is the process group that really runs
        raise ConfigError(
            "batch_size", config.batch_size, f"must be divisible by 2 * {world} workers: each takes an equal slice of each half"
        )
    batches1, batches2, augment_seed = _epoch_batches(objective, len(train_split), d1, d2, epoch, config, rank, world)
    model.train()
    totals: dict[str, torch.Tensor] = {}
    steps = 0
    for (x1, y1), (x2, y2) in zip(
        train_split.batches(batches1, augment=True, seed=augment_seed),
        train_split.batches(batches2, augment=True, seed=augment_seed),
    ):
        batch = [t.to(env.device, non_blocking=True) for t in (x1, y1, x2, y2)]
        if step is None:
            step = make_step(batch)
        for name, value in step(*batch).items():
            totals[name] = totals.get(name, 0) + value
        steps += 1
        if config.debug_sync_checks:
            env.check_in_sync(model, objective)
        yield
    means = {name: float(env.collective.mean(total / steps)) for name, total in totals.items()}
    if not math.isfinite(means["upper"]):
        raise DivergedError(f"training loss is {means['upper']} in epoch {epoch + 1} (method {config.method}, lr {config.lr})")
    return {
        **{column: means[stat] for stat, column in STAT_COLUMNS.items()},
        "q": means["quantile"] if objective.learned_quantile() is None else objective.learned_quantile(),
    }, step


def diagnostic_sample(train_size: int, config: TrainConfig) -> torch.Tensor | None:
    """The training positions the epoch diagnostics score, in order: a seeded sample of
    ``config.diagnostic_examples`` (the same every epoch), or None for the whole split (the
    setting 0, or a split no larger than the sample)."""
    if config.diagnostic_examples == 0 or config.diagnostic_examples >= train_size:
        return None
    return torch.randperm(train_size, generator=generator(config.seed, "diagnostics"))[: config.diagnostic_examples].sort().values


def _diagnosing(model, objective: Objective, data: DataSplits, d1, d2, config: TrainConfig, env, forwards: Forwards | None = None):
    """The quantile's diagnostics at the end of an epoch, from the training split (or the seeded
    sample ``diagnostic_sample`` of it, D1 and D2 then their parts in the sample) in eval mode
    without augmentation (docs/results.md, epochs.parquet).

    Against Algorithm 1's lower level on D1: Q_n of D1's scores, the quantile's error, and the soft
    set size of D2 at Q_n.  Against the paper's figures, which take Q_n over the whole training set:
    the error (figure 3(a)), the upper loss CE + lambda * soft size and the lower (pinball) loss at
    the learned quantile and at Q_n, with their gaps (figure 2(c)(d)), and the soft and hard set
    size at the learned quantile (figure 3(c), beside the validation set size).  The learned
    quantile is DPSM's q, or ConfTr's batch quantiles -- the training split's scores cut into random
    calibration batches of the run's size, each quantity averaged over them.  Methods without a
    quantile get NaN for every quantity that needs one.  Yields after each batch of its forward
    pass."""
    sample = diagnostic_sample(len(data.train), config)
    if sample is not None:  # D1 and D2 as positions within the sample (the whole split where the sample misses one)
        position = torch.full((len(data.train),), -1, dtype=torch.long)
        position[sample] = torch.arange(sample.numel())
        parts = [position[half][position[half] >= 0] for half in (d1, d2)]
        if min(part.numel() for part in parts) > 0:
            d1, d2 = parts
        else:
            sample = None
    positions = torch.arange(len(data.train)) if sample is None else sample
    logits = yield from predicting(model, data.train, positions, data.num_classes, env, config.precision, forwards)
    labels = data.train.labels[positions].to(logits.device)
    scores = hps_scores(logits).double()
    train_scores = label_scores(scores, labels)
    d1_scores, device = train_scores[d1.to(logits.device)], logits.device
    level = 1 - config.alpha
    q_dataset, q_train = empirical_quantile(d1_scores, level), empirical_quantile(train_scores, level)
    learned = _learned_quantiles(objective, d1_scores, train_scores, config)
    row = {
        "q_dataset": float(q_dataset),
        "soft_size": float(soft_set_size(scores[d2.to(device)], q_dataset, config.sigmoid_temperature)),
        "q_dataset_train": float(q_train),
        **{
            name: math.nan
            for name in (
                "q_error",
                "q_error_train",
                "upper_loss_q",
                "upper_loss_qn",
                "upper_gap",
                "lower_loss_q",
                "lower_loss_qn",
                "lower_gap",
                "train_soft_size_q",
                "train_set_size_q",
            )
        },
    }
    if learned is None:
        return row
    learned = learned.to(device)
    block = max(1, _DIAGNOSTIC_BLOCK // scores.numel())

    def at_learned(quantity) -> float:
        """``quantity`` (thresholds ``[c]`` -> values ``[c]``) averaged over the learned quantiles."""
        return float(torch.cat([quantity(part) for part in learned.split(block)]).mean())

    ce = float(F.cross_entropy(logits.double(), labels))
    soft_q = at_learned(lambda q: soft_set_size(scores, q, config.sigmoid_temperature))
    soft_qn = float(soft_set_size(scores, q_train, config.sigmoid_temperature))
    lower_q = at_learned(lambda q: pinball_loss(q[:, None], train_scores, config.alpha))
    lower_qn = float(pinball_loss(q_train, train_scores, config.alpha))
    row.update({
        "q_error": float((learned - q_dataset).abs().mean()),
        "q_error_train": float((learned - q_train).abs().mean()),
        "upper_loss_q": ce + config.conformal_weight * soft_q,
        "upper_loss_qn": ce + config.conformal_weight * soft_qn,
        "upper_gap": config.conformal_weight * (soft_q - soft_qn),
        "lower_loss_q": lower_q,
        "lower_loss_qn": lower_qn,
        "lower_gap": lower_q - lower_qn,
        "train_soft_size_q": soft_q,
        "train_set_size_q": at_learned(lambda q: set_size(prediction_sets(scores, q))),
    })
    return row


epoch_diagnostics = _driven(_diagnosing)


class Untouched:
    """Within it, the run's state is measured, not changed: torch's RNG (dropout), the network's
    buffers (BatchNorm's running statistics, which a forward in train mode updates) and the
    objective's state tensors (DPSM's q, CUT's step count, which its call steps) are put back as
    they were, in place -- a captured step finds them at the same addresses."""

    def __init__(self, model: nn.Module, objective: Objective, device: torch.device) -> None:
        self.net, self.objective, self.device = unwrap(model), objective, device

    def __enter__(self):
        # the state on the device first: a call moves it there as a new tensor (``prepare``), which
        # the snapshot below would miss; the run's first step would have moved it all the same
        self.objective.prepare(self.device)
        self.rng = torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])
        self.rng.__enter__()
        self.training = self.net.training
        self.state = self.objective.state_tensors()
        self.saved = [(t, t.detach().clone()) for t in [*self.net.buffers(), *self.state]]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for tensor, value in self.saved:
                tensor.copy_(value)
        self.net.train(self.training)
        moved = [a is not b for a, b in zip(self.state, self.objective.state_tensors())]
        if any(moved) or len(self.state) != len(self.objective.state_tensors()):
            raise RuntimeError("the objective replaced its state tensors during a diagnostic call: it must update them in place")
        return self.rng.__exit__(*exc)


def term_gradient_norms(
    model, objective: Objective, train_split: Split, d1, d2, epoch: int, config: TrainConfig, env, channels_last: bool = False
) -> dict:
    """The norm of the gradient of each term of the loss -- CE, and the size term lambda x L_c --
    at the epoch's first batch, before its first step (epoch 1: the run's first step), in train
    mode with the batch's augmentation: whether a configuration's size term is active, against
    CE's.  Nothing of the run changes (``Untouched``).  NaN where the method's loss is not CE plus a
    size term (``ObjectiveOutput.parts``: ConfTS, RWCE, ConfTr as published) or the run spans
    several workers (their steps share the gradient)."""
    nan = {"ce_grad_norm": math.nan, "size_grad_norm": math.nan}
    if env.collective.world_size > 1:
        return nan
    batches1, batches2, seed = _epoch_batches(objective, len(train_split), d1, d2, epoch, config, 0, 1)  # the epoch's first step's
    (x1, y1), (x2, y2) = (next(train_split.batches(b[:1], augment=True, seed=seed)) for b in (batches1, batches2))
    net = unwrap(model)
    weights = [p for p in net.parameters() if p.requires_grad]
    with Untouched(model, objective, env.device):
        net.train()  # the step's own forward: B1 and B2 in one batch (BatchNorm's statistics), its precision and memory format
        x1, y1, x2, y2 = (t.to(env.device) for t in (x1, y1, x2, y2))
        out = forward_objective(net, objective, x1, y1, x2, y2, config.precision, channels_last)
        if out.parts is None or not weights:
            return nan
        norms = {}
        for name, term in out.parts.items():  # CE's size term is a constant 0: no gradient
            grads = torch.autograd.grad(term.float(), weights, retain_graph=True, allow_unused=True) if term.requires_grad else ()
            squares = [g.double().pow(2).sum() for g in grads if g is not None]  # read back once: a read per weight waits per weight
            norms[f"{name}_grad_norm"] = math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0
    return norms


def _train_mode_scoring(model, objective: Objective, train_split: Split, d1, epoch: int, config: TrainConfig, env, forwards=None):
    """The quantile diagnostics like for like with what a method learns from: the training examples'
    scores as training sees them -- augmented, the network in train mode, in batches of the run's
    size -- their Q_n, and the learned quantile's distance to it (DPSM's q; ConfTr's batch quantiles
    recomputed from these scores).  ``q_error_train`` holds the same against eval-mode scores.  The
    ``_d1`` pair holds the same against the Q_n of the sample's D1 part alone: what DPSM's lower
    level fits (its pinball loss sees B1, drawn from D1), and ConfTr's B1 with the halves split.
    The examples are ``diagnostic_sample``'s; nothing of the run changes.  Yields after each batch
    of its forward pass."""
    nan = {"q_dataset_train_mode": math.nan, "q_error_train_mode": math.nan, "q_dataset_train_mode_d1": math.nan,
           "q_error_train_mode_d1": math.nan}
    if env.collective.world_size > 1:
        return nan
    sample = diagnostic_sample(len(train_split), config)
    positions = torch.arange(len(train_split)) if sample is None else sample
    # in a seeded order, as training draws its batches (a split stored class by class would give
    # BatchNorm one class a batch), cut into batches of at least the run's size (none of one example)
    positions = positions[torch.randperm(positions.numel(), generator=generator(config.seed, "train-mode order", epoch))]
    net = unwrap(model)
    seed = derive_seed(config.seed, "train-mode scores", epoch)
    # Untouched spans the yields (it holds this run's state only); a grad mode must not: Forwards turns gradients off per batch
    with Untouched(model, objective, env.device):
        net.train()
        logits, labels = [], []
        batches = list(positions.tensor_split(max(1, positions.numel() // config.batch_size)))
        forwards = forwards or Forwards(config.precision)
        for x, y in train_split.batches(batches, augment=True, seed=seed):
            logits.append(forwards(net, x.to(env.device)))
            labels.append(y.to(env.device))
            yield
    scores = label_scores(hps_scores(torch.cat(logits)).double(), torch.cat(labels))
    in_d1 = torch.isin(positions, d1).to(scores.device)
    q_train = empirical_quantile(scores, 1 - config.alpha)
    learned = _learned_quantiles(objective, scores[in_d1], scores, config)
    q_d1 = empirical_quantile(scores[in_d1], 1 - config.alpha) if bool(in_d1.any()) else None
    error = math.nan if learned is None else float((learned.to(scores.device) - q_train).abs().mean())
    error_d1 = math.nan if learned is None or q_d1 is None else float((learned.to(scores.device) - q_d1).abs().mean())
    return {"q_dataset_train_mode": float(q_train), "q_error_train_mode": error,
            "q_dataset_train_mode_d1": math.nan if q_d1 is None else float(q_d1), "q_error_train_mode_d1": error_d1}


train_mode_quantiles = _driven(_train_mode_scoring)


def _learned_quantiles(
    objective: Objective, d1_scores: torch.Tensor, train_scores: torch.Tensor, config: TrainConfig
) -> torch.Tensor | None:
    """The quantile(s) a method trains with, at the current model (``Objective.training_quantiles``):
    DPSM's q; ConfTr's batch quantiles; None for CE, CUT and ConfTr as published (whose tau lives
    on the -log p scale, not on the HPS scores these diagnostics use)."""
    return objective.training_quantiles(d1_scores, train_scores, config.batch_size, generator(config.seed, "q_error"), _DIAGNOSTIC_BATCHES)


def validating(model, val: Split, num_classes: int, config: TrainConfig, env, forwards: Forwards | None = None):
    """Split conformal inside the validation split (HPS), averaged over re-splits: what a sweep selects
    on.  The test data is never looked at.  Yields after each batch of its forward pass."""
    logits = yield from predicting(model, val, torch.arange(len(val)), num_classes, env, config.precision, forwards)
    resplits = Resplits(
        score_functions(("hps",)), splits=config.val_splits, cal_fraction=0.5, seed=derive_seed(config.seed, "val"), example_ids=val.ids
    )
    rows = evaluate(logits.double().softmax(dim=1).cpu(), val.labels, config.alpha, resplits, wsc_directions=1)
    return {
        "val_coverage": sum(r["coverage"] for r in rows) / len(rows),
        "val_set_size": sum(r["set_size"] for r in rows) / len(rows),
        "val_accuracy": rows[0]["accuracy"],
    }


validation_metrics = _driven(validating)


def _evaluating(model, data: DataSplits, config: TrainConfig, env, forwards: Forwards | None = None):
    """The paper's protocol: pool cal and test, re-split at random ``eval_splits`` times keeping the
    calibration size, and evaluate every score: one row per score and re-split, and one per score,
    re-split and class (the class-conditional coverage of the paper's figures 5-6).  Yields after
    each batch of its forward passes."""
    logits = []
    for part in (data.cal, data.test):
        logits.append((yield from predicting(model, part, torch.arange(len(part)), data.num_classes, env, config.precision, forwards)))
    probs = (
        torch.cat(logits)
        .double()
        .softmax(dim=1)
        .cpu()
    )
    labels = torch.cat([data.cal.labels, data.test.labels])
    resplits = Resplits(
        score_functions(config.eval_scores),
        splits=config.eval_splits,
        cal_fraction=len(data.cal) / (len(data.cal) + len(data.test)),
        seed=config.seed,
        example_ids=torch.cat([data.cal.ids, data.test.ids]).cpu(),
        calibrations=config.eval_calibrations,
    )
    classes = evaluate_classes(probs, labels, config.alpha, resplits)
    for row in classes:
        row["class_name"] = data.class_names[row["label"]] if data.class_names else None
    return evaluate(probs, labels, config.alpha, resplits), classes


final_evaluation = _driven(_evaluating)


def _progress_line(row: dict, config: TrainConfig, uses_quantile: bool) -> EpochLine:
    quantile = ""
    if uses_quantile:
        quantile = f"  q {row['q']:.4f}  Q_n {row['q_dataset']:.4f}  |q-Q_n| {row['q_error']:.4f}"
    text = (
        f"[{config.method}] epoch {row['epoch']:>3}/{config.epochs}  upper {row['upper_loss']:.4f}"
        f"{quantile}  val cov {row['val_coverage']:.3f}  val size {row['val_set_size']:.2f}  ({row['epoch_seconds']:.1f}s)"
    )
    return EpochLine(
        text, epoch=row["epoch"], epochs=config.epochs, seconds=row["epoch_seconds"], val_set_size=row["val_set_size"], method=config.method
    )
