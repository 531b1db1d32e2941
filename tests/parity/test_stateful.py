"""Stateful modules: Rngs, Dropout, BatchNorm, optimizers, metrics, sow, caches, refs,
Variable hooks and plain array attributes, each called three times or more."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ._harness import Block, Counter, Pair, X, mse, parity

# 1. Rngs


class Holder(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs
        self.linear = nnx.Linear(2, 2, rngs=rngs)


RNG_FUNCTIONS = {
    "default_stream": lambda rngs: rngs.normal((3,)),
    "two_streams": lambda rngs: (rngs.params.uniform((2,)), rngs.dropout.normal((2,))),
    "raw_keys": lambda rngs: (rngs(), rngs.dropout()),
    "fork": lambda rngs: rngs.fork(),
    "split": lambda rngs: rngs.split(2),
    "held_by_module": lambda h: h.linear(X) + h.rngs.normal((2,)),
}


@pytest.mark.parametrize("fn", RNG_FUNCTIONS.values(), ids=RNG_FUNCTIONS.keys())
def test_rngs_advance_as_in_flax(fn):
    def scenario(impl, log):
        rngs = nnx.Rngs(0, dropout=1)
        arg = Holder(rngs) if fn is RNG_FUNCTIONS["held_by_module"] else rngs
        f = impl.jit(fn)
        for i in range(3):
            log.value(f"out{i}", f(arg))
        log.state("rngs", rngs)

    parity(scenario)


def test_rngs_argument_next_to_a_module_drives_dropout():
    def forward(m, rngs, x):
        return m.dropout(m.linear(x), rngs=rngs)

    def scenario(impl, log):
        model = Block(nnx.Rngs(0))  # its own dropout stream is not used
        rngs = nnx.Rngs(dropout=5)
        f = impl.jit(forward)
        for i in range(3):
            log.value(f"out{i}", f(model, rngs, X))
        log.state("after", model, rngs)

    parity(scenario)


def test_reseed_between_calls_repeats_the_masks():
    def scenario(impl, log):
        model = Block(nnx.Rngs(0, dropout=1))
        f = impl.jit(lambda m, x: m(x))
        for i in range(4):
            if i == 2:
                nnx.reseed(model, dropout=1)
            log.value(f"out{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


# 2. Dropout and BatchNorm, train and eval


class Net(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, momentum=0.5, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.bn(self.linear(x)))))


MODES = {
    "train": lambda m: m.train(),
    "eval": lambda m: m.eval(),
    "eval_dropout_only": lambda m: m.dropout.eval(),
    "deterministic_attribute": lambda m: m.set_attributes(deterministic=True),
    "running_average_attribute": lambda m: m.set_attributes(use_running_average=True),
}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_dropout_and_batchnorm_in_each_mode(mode):
    def scenario(impl, log):
        model = Net()
        mode(model)
        f = impl.jit(lambda m, x: m(x))
        for i in range(3):
            log.value(f"out{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


def test_dropout_deterministic_as_static_keyword():
    def forward(m, x, *, deterministic):
        return m.dropout(m.linear(x), deterministic=deterministic)

    def scenario(impl, log):
        model = Net()
        f = impl.jit(forward, static_argnames="deterministic")
        for i, flag in enumerate([False, True, False, True]):
            log.value(f"out{i}", f(model, X, deterministic=flag))
        log.state("model", model)

    parity(scenario)


def test_batchnorm_statistics_in_a_train_step_with_grad():
    def step(m, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        nnx.update(m, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(m, nnx.Param), grads))
        return loss

    def scenario(impl, log):
        model = Net()
        f = impl.jit(step)
        for i in range(3):
            log.value(f"loss{i}", f(model, X * (i + 1)))
        log.state("model", model)

    parity(scenario)


# 3. nnx.Optimizer with optax transformations

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "chain_clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "chain_scale_by_adam": lambda: optax.chain(
        optax.clip(0.5), optax.scale_by_adam(), optax.scale(-1e-2)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
    "multi_steps": lambda: optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
    "schedule": lambda: optax.adam(optax.linear_schedule(0.1, 0.0, 3)),
}


def train_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(mse)(model, x)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("tx", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_optimizer_steps(tx):
    def scenario(impl, log):
        # Pair (with BatchNorm statistics outside wrt=nnx.Param) for the chain, else small
        model = Pair() if tx is OPTIMIZERS["chain_clip_adam"] else Counter()
        optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
        f = impl.jit(train_step)
        for i in range(3):
            log.value(f"loss{i}", f(model, optimizer, X))
        log.state("after", model, optimizer)

    parity(scenario)


def test_optimizer_and_model_in_one_container_returned():
    def step(pair, x):
        model, optimizer = pair
        loss = train_step(model, optimizer, x)
        return pair, loss

    def scenario(impl, log):
        model = Counter()
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        f = impl.jit(step, donate_argnums=0)
        for i in range(3):
            (m, o), loss = f((model, optimizer), X)
            log.fact(f"identities{i}", (m is model, o is optimizer))
            log.value(f"loss{i}", loss)
        log.state("after", model, optimizer)

    parity(scenario)


def test_learning_rate_changed_between_calls():
    def scenario(impl, log):
        model = Counter()
        tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        f = impl.jit(train_step)
        for i in range(4):
            if i == 2:
                optimizer.opt_state.hyperparams["learning_rate"][...] = 0.5
            log.value(f"loss{i}", f(model, optimizer, X))
        log.state("after", model, optimizer)

    parity(scenario)


# 4. metrics


def eval_step(model, metrics, x, labels):
    logits = model(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    metrics.update(loss=loss, logits=logits, labels=labels)
    return loss


LABELS = jnp.array([0, 1, 1, 0])


def test_multi_metric_updated_reset_and_computed():
    def scenario(impl, log):
        model = Counter()
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())
        f = impl.jit(eval_step)
        for i in range(4):
            if i == 2:
                metrics.reset()
            log.value(f"loss{i}", f(model, metrics, X * (i + 1), LABELS))
            log.value(f"computed{i}", metrics.compute())
        log.state("after", model, metrics)

    parity(scenario)


@pytest.mark.parametrize("metric", [nnx.metrics.Average, nnx.metrics.Welford])
def test_single_metric_argument(metric):
    def scenario(impl, log):
        m = metric()
        f = impl.jit(lambda m, v: m.update(values=v))
        for i in range(3):
            f(m, X[:, 0] * (i + 1))
            log.value(f"computed{i}", m.compute())
        log.state("metric", m)

    parity(scenario)


def test_train_step_with_optimizer_metrics_and_dropout():
    def step(model, optimizer, metrics, x, labels):
        def loss_fn(model):
            logits = model(x)
            return optax.sigmoid_binary_cross_entropy(logits[:, 0], labels).mean(), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

    def scenario(impl, log):
        model = Net()
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        f = impl.jit(step, donate_argnames=("model", "optimizer"))
        for i in range(3):
            log.value(f"out{i}", f(model, optimizer, metrics, X, LABELS.astype(jnp.float32)))
            log.value(f"loss{i}", metrics.compute())
        log.state("after", model, optimizer, metrics)

    parity(scenario)


# 5. sow and nnx.capture


class Sower(nnx.Module):
    def __init__(self, reduce=None):
        self.l1 = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(3, 1, rngs=nnx.Rngs(1))
        self.reduce = reduce

    def __call__(self, x):
        h = self.l1(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # sow outside nnx.capture
            if self.reduce is None:
                self.sow(nnx.Intermediate, "h", h)
            else:
                self.sow(nnx.Intermediate, "h", h, reduce_fn=self.reduce, init_fn=lambda: 0.0)
        return self.l2(h)


def test_sow_accumulates_on_the_model_across_calls():
    # the default reduce appends to a tuple: the model's structure changes every call
    def scenario(impl, log):
        model = Sower()
        f = impl.jit(lambda m, x: m(x))
        for i in range(3):
            log.value(f"out{i}", f(model, X * (i + 1)))
            log.state(f"model{i}", model)

    parity(scenario)


def test_sow_with_a_summing_reduce():
    def scenario(impl, log):
        model = Sower(reduce=lambda a, b: a + b)
        f = impl.jit(lambda m, x: m(x))
        for i in range(3):
            log.value(f"out{i}", f(model, X * (i + 1)))
        log.state("model", model)

    parity(scenario)


def test_sow_and_pop_intermediates_inside():
    def forward(m, x):
        y = m(x)
        return y, nnx.pop(m, nnx.Intermediate)

    def scenario(impl, log):
        model = Sower()
        f = impl.jit(forward)
        for i in range(3):
            log.value(f"out{i}", f(model, X * (i + 1)))
        log.state("model", model)

    parity(scenario)


class Capturer(nnx.Module):
    def __init__(self):
        self.l1 = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(3, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):
        h = self.l1(x)
        self.sow(nnx.Intermediate, "h", h)
        return self.l2(h)


def test_capture_inside_jit():
    def scenario(impl, log):
        model = Capturer()
        f = impl.jit(lambda m, x: nnx.capture(m, nnx.Intermediate)(x))
        for i in range(3):
            log.value(f"out{i}", f(model, X * (i + 1)))
        log.state("model", model)

    parity(scenario)


def test_capture_around_jit():
    # nnx.capture puts its collector on the module for the duration of the call
    def scenario(impl, log):
        model = Capturer()
        f = nnx.capture(impl.jit(lambda m, x: m(x)), nnx.Intermediate)
        for i in range(3):
            log.value(f"out{i}", f(model, X * (i + 1)))
        log.state("model", model)

    parity(scenario)


# 6. a KV cache decoded step by step


class Decoder(nnx.Module):
    def __init__(self, length=6, width=2):
        self.q = nnx.Linear(width, width, rngs=nnx.Rngs(0))
        self.keys = nnx.Cache(jnp.zeros((length, width)))
        self.values = nnx.Cache(jnp.zeros((length, width)))
        self.index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, token):
        i = self.index[...]
        self.keys[...] = jax.lax.dynamic_update_slice(self.keys[...], token[None], (i, 0))
        self.values[...] = jax.lax.dynamic_update_slice(self.values[...], 2 * token[None], (i, 0))
        self.index[...] = i + 1
        mask = jnp.arange(self.keys.shape[0]) <= i
        scores = jnp.where(mask, self.keys[...] @ self.q(token), -jnp.inf)
        return jax.nn.softmax(scores) @ self.values[...]


def test_kv_cache_decode_loop():
    def scenario(impl, log):
        model = Decoder()
        step = impl.jit(lambda m, t: m(t))
        token = X[0]
        for i in range(5):
            token = log.value(f"token{i}", step(model, token))
        log.state("model", model)

    parity(scenario)


def test_kv_cache_reset_from_outside_between_steps():
    def scenario(impl, log):
        model = Decoder()
        step = impl.jit(lambda m, t: m(t))
        for i in range(5):
            if i == 3:
                model.index[...] = jnp.array(0, jnp.int32)
                model.keys[...] = jnp.zeros_like(model.keys[...])
            log.value(f"token{i}", step(model, X[i % 4]))
        log.state("model", model)

    parity(scenario)


def test_multi_head_attention_decode_with_init_cache():
    def scenario(impl, log):
        mha = nnx.MultiHeadAttention(
            num_heads=2, in_features=4, qkv_features=4, decode=True, rngs=nnx.Rngs(0)
        )
        mha.init_cache((1, 4, 4))
        step = impl.jit(lambda m, x: m(x))
        x = jnp.ones((1, 1, 4))
        for i in range(4):
            x = log.value(f"out{i}", step(mha, x))
        log.state("mha", mha)

    parity(scenario)


# 7. ref Variables (issue 15, A.2)


def test_ref_variable_updated_in_place_three_times():
    def bump(m):
        m.w[...] += 1
        return m.w[...].sum()

    def scenario(impl, log):
        m = nnx.Module()
        m.w = nnx.Param(jnp.ones(3), ref=True)
        f = impl.jit(bump)
        outs = [log.value(f"out{i}", f(m)) for i in range(3)]
        log.fact("sums", [float(o) for o in outs])  # 6, 9, 12 in flax
        log.state("m", m)

    parity(scenario)


def test_ref_variable_next_to_a_plain_one():
    class Mixed(nnx.Module):
        def __init__(self):
            self.ref = nnx.BatchStat(jnp.zeros(2), ref=True)
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(m, x):
        y = m.linear(x)
        m.ref[...] += y.sum(0)
        m.linear.bias[...] += 0.5
        return y, m.ref[...]

    def scenario(impl, log):
        m = Mixed()
        f = impl.jit(step)
        for i in range(3):
            log.value(f"out{i}", f(m, X))
        log.state("m", m)

    parity(scenario)


# 8. Variable types with hooks, and metadata read inside


class Scaled(nnx.Param):
    """Reads as its value times its ``scale`` metadata."""

    def get_value(self, **kwargs):
        return super().get_value(**kwargs) * self.get_metadata("scale", 1.0)


class Clipped(nnx.BatchStat):
    """Clips what is written to [-1, 1]."""

    def set_value(self, value, **kwargs):
        return super().set_value(jnp.clip(value, -1.0, 1.0), **kwargs)


def test_variable_type_with_a_get_value_hook():
    def scenario(impl, log):
        m = nnx.Module()
        m.w = Scaled(jnp.arange(3.0), scale=3.0)
        f = impl.jit(lambda m, x: m.w[...] * x)
        for i in range(3):
            log.value(f"out{i}", f(m, jnp.float32(i)))
        log.state("m", m)

    parity(scenario)


def test_variable_type_with_a_set_value_hook():
    def step(m, x):
        m.s.set_value(m.s.get_value() + x)
        return m.s.get_value()

    def scenario(impl, log):
        m = nnx.Module()
        m.s = Clipped(jnp.zeros(2))
        f = impl.jit(step)
        for i in range(3):
            log.value(f"out{i}", f(m, jnp.full(2, 0.4)))
        log.state("m", m)

    parity(scenario)


def test_metadata_hook_on_set_value():
    def clip(variable, value):
        return jnp.clip(value, -1.0, 1.0)

    def scenario(impl, log):
        m = nnx.Module()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # metadata hooks are deprecated in flax
            m.s = nnx.BatchStat(jnp.zeros(2), on_set_value=clip)
        f = impl.jit(lambda m, x: m.s.set_value(m.s.get_value() + x))
        for i in range(3):
            f(m, jnp.full(2, 0.4))
            log.state(f"m{i}", m)

    parity(scenario)


def test_variable_metadata_read_inside():
    def scenario(impl, log):
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        model.kernel.set_metadata(scale=2.0)
        f = impl.jit(lambda m, x: m(x) * m.kernel.get_metadata("scale"))
        for i in range(3):
            log.value(f"out{i}", f(model, X))
        log.state("model", model)

    parity(scenario)


# 9. arrays held outside Variables (issue 15, A.4 and B.14)


class Plain(nnx.Module):
    def __init__(self):
        self.count = jnp.array(0)
        self.offset = jnp.ones(2)
        self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))


def test_plain_array_attribute_counter():
    def step(c):
        c.count += 1
        return c.count

    def scenario(impl, log):
        c = Plain()
        f = impl.jit(step)
        for i in range(3):
            log.value(f"count{i}", f(c))
        log.state("c", c)

    parity(scenario)


def test_plain_array_attribute_read_only():
    def scenario(impl, log):
        c = Plain()
        f = impl.jit(lambda c, x: c.linear(x) + c.offset)
        for i in range(3):
            log.value(f"out{i}", f(c, X))
            c.offset = c.offset * 2  # replaced from outside
        log.state("c", c)

    parity(scenario)


def test_numpy_array_attribute_becomes_a_jax_array():
    def scenario(impl, log):
        c = Plain()
        c.offset = np.full(2, 3.0, np.float32)
        c.linear.bias.set_value(np.zeros(2, np.float32))
        f = impl.jit(lambda c, x: c.linear(x) + c.offset)
        for i in range(3):
            log.value(f"out{i}", f(c, X))
            log.state(f"c{i}", c)

    parity(scenario)


def test_arrays_in_an_nnx_data_list_updated_inside():
    def step(m):
        m.items[0] = m.items[0] + 1
        m.items.append(m.items[-1] * 2)
        return len(m.items)

    def scenario(impl, log):
        m = nnx.Module()
        m.items = nnx.data([jnp.zeros(2)])
        f = impl.jit(step)
        for i in range(3):
            log.value(f"out{i}", f(m))
            log.state(f"m{i}", m)

    parity(scenario)


# 10. Counters on nested modules, updated through aliases


def test_counter_updated_through_two_aliases():
    def scenario(impl, log):
        model = Pair()
        model.alias = model.a
        f = impl.jit(lambda m, x: (m.a(x), m.alias(x)))
        for i in range(3):
            log.value(f"out{i}", f(model, X))
        log.fact("alias", model.alias is model.a)
        log.state("model", model)

    parity(scenario)


def test_block_with_dropout_called_twice_per_step():
    def scenario(impl, log):
        block = Block(nnx.Rngs(0, dropout=3))
        f = impl.jit(lambda b, x: b(b(x)))
        for i in range(3):
            log.value(f"out{i}", f(block, X))
        log.state("block", block)

    parity(scenario)
