# A forward hook that changes a module's output, in a model with BatchNorm and its state.
import equinox as eqx
import jax

import jhooks


class Net(jhooks.Module):  # a hookable eqx.Module, its stock layers too
    fc: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __call__(self, x, state):  # one example; the state is threaded through
        y, state = self.bn(self.fc(x), state)
        return self.out(jax.nn.relu(y)), state


layers = eqx.nn.Linear(3, 8, key=jax.random.key(0)), eqx.nn.BatchNorm(8, "batch", mode="batch")
model, state = eqx.nn.make_with_state(Net)(*layers, eqx.nn.Linear(8, 2, key=jax.random.key(1)))


def halve(module, args, output):  # a stateful layer's output is (y, state)
    return output[0] * 0.5, output[1]


jhooks.register_forward_hook(model.bn, halve)
batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
x = jax.random.normal(jax.random.key(2), (16, 3))
out, state = eqx.filter_jit(batched)(x, state)
print(out[:2], state)
