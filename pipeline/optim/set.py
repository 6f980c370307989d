"""OptimizerSet: several optimizers (param groups) used as one.

A PyTorch param group is {hyperparameters, params, state}, which is exactly
one optimizer instance; the set steps, zeroes, clips (globally, across all
members, like clip_grad_norm_(model.parameters())) and saves them together.
Adding a member that shares a parameter with an existing member is an error,
so no parameter is ever stepped twice.

Persistence namespaces members by position: tensors "<i>.<slot>.<buffer>",
scalars "<i>.<slot>.step", config {"members": [{"type", "config"}, ...]}.
"""
from __future__ import annotations

from pipeline.errors import ConfigMismatchError

from .base import OptimizerConfigError


class OptimizerSet:
    TYPE = "set"

    def __init__(self, *members):
        self.members = []
        for m in members:
            self.add(m)

    def add(self, optimizer):
        """Add a member; a parameter already owned by another member is an error."""
        owned = {id(t): (i, n) for i, m in enumerate(self.members) for n, t in m.named_parameters()}
        for name, t in optimizer.named_parameters():
            if id(t) in owned:
                i, other = owned[id(t)]
                raise OptimizerConfigError(f"OptimizerSet.add: parameter {name!r} is already stepped by member {i} "
                                           f"(as {other!r}); it would be stepped twice")
        if any(optimizer is m for m in self.members):
            raise OptimizerConfigError("OptimizerSet.add: this optimizer is already a member")
        self.members.append(optimizer)
        return optimizer

    def step(self):
        for m in self.members:
            m.step()

    def zero_grad(self):
        for m in self.members:
            m.zero_grad()

    def named_parameters(self):
        return [(n, t) for m in self.members for n, t in m.named_parameters()]

    def grads(self):
        return [(n, g) for m in self.members for n, g in m.grads()]

    def lr_holders(self):
        return [h for m in self.members for h in m.lr_holders()]

    @property
    def param_groups(self):
        return [g for m in self.members for g in m.param_groups]

    def clip_grad_norm(self, max_norm):
        """Global clip across all members; returns the pre-clip norm."""
        from .clip import clip_grad_norm
        return clip_grad_norm(self, max_norm)

    def scale_gradients(self, factor):
        from .clip import scale_gradients
        scale_gradients(self, factor)

    def state_dict(self):
        tensors, scalars, members = {}, {}, []
        for i, m in enumerate(self.members):
            sd = m.state_dict()
            members.append({"type": sd["type"], "config": sd["config"]})
            tensors.update({f"{i}.{k}": v for k, v in sd["tensors"].items()})
            scalars.update({f"{i}.{k}": v for k, v in sd["scalars"].items()})
        return {"type": self.TYPE, "config": {"members": members}, "tensors": tensors, "scalars": scalars}

    def load_state_dict(self, sd, source="optimizer state"):
        if not isinstance(sd, dict) or sd.get("type") != self.TYPE:
            raise ConfigMismatchError(f"{source}: field 'type' is "
                                      f"{sd.get('type') if isinstance(sd, dict) else None!r}, expected 'set'")
        stored = (sd.get("config") or {}).get("members", [])
        if len(stored) != len(self.members):
            raise ConfigMismatchError(f"{source}: field 'config.members' has {len(stored)} members, "
                                      f"this set has {len(self.members)}")
        for i, (m, info) in enumerate(zip(self.members, stored)):
            prefix = f"{i}."
            sub = {"type": info.get("type"), "config": info.get("config"),
                   "tensors": {k[len(prefix):]: v for k, v in sd.get("tensors", {}).items() if k.startswith(prefix)},
                   "scalars": {k[len(prefix):]: v for k, v in sd.get("scalars", {}).items() if k.startswith(prefix)}}
            m.load_state_dict(sub, source=f"{source} (member {i})")
