"""Variable trackers shared by the families: polyfills, constant folds, graph breaks, state contexts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch._dynamo.bytecode_transformation import create_call_function
from torch._dynamo.exc import unimplemented
from torch._dynamo.guards import GuardBuilder
from torch._dynamo.variables.base import VariableTracker
from torch._dynamo.variables.constant import ConstantVariable
from torch._dynamo.variables.ctx_manager import ContextWrappingVariable
from torch._dynamo.variables.functions import UserFunctionVariable

Handler = Callable[[Any, Any], VariableTracker]


def _guard_identity(builder: Any) -> None:
    """The traced function stays the one seen at trace time (a rebinding recompiles)."""
    builder.install_guards(GuardBuilder.CLOSURE_MATCH)


def polyfill(replacement: Callable[..., Any]) -> Handler:
    """Trace ``replacement`` (traceable Python with the same signature) where the user calls the original."""

    def handler(builder: Any, value: Any) -> VariableTracker:
        _guard_identity(builder)
        return UserFunctionVariable(replacement)

    return handler


class FoldedFunctionVariable(VariableTracker):
    """A pure function of constants (ints, meshes, placements), run at trace time.

    The rule: every argument is a Python constant to Dynamo (guarded where it came
    from) and the result depends only on the arguments, so the result is a constant.
    """

    def __init__(self, fn: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fn = fn

    def python_type(self) -> type:
        return type(self.fn)

    def as_python_constant(self) -> Any:
        return self.fn

    def call_function(self, tx: Any, args: Sequence[VariableTracker], kwargs: dict[str, VariableTracker]) -> VariableTracker:
        try:
            const_args = [a.as_python_constant() for a in args]
            const_kwargs = {k: v.as_python_constant() for k, v in kwargs.items()}
        except NotImplementedError:
            unimplemented(
                gb_type="dtcompile: non-constant argument to a mesh/placement helper",
                context=f"{self.fn.__qualname__}({args}, {kwargs})",
                explanation=(
                    f"{self.fn.__qualname__} is evaluated at trace time, which needs every argument "
                    "(shapes, mesh, placements) to be known then; one is a traced value."
                ),
                hints=["Pass static shapes (e.g. tensor.shape of a non-dynamic tensor) and the mesh and placements themselves."],
            )
        return VariableTracker.build(tx, self.fn(*const_args, **const_kwargs))


def fold(builder: Any, value: Any) -> VariableTracker:
    _guard_identity(builder)
    return FoldedFunctionVariable(value)


class GraphBreakFunctionVariable(VariableTracker):
    """A function that cannot run inside a compiled region: a structured graph break with a hint."""

    def __init__(self, fn: Callable[..., Any], explanation: str, hints: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fn = fn
        self.explanation = explanation
        self.hints = hints

    def python_type(self) -> type:
        return type(self.fn)

    def call_function(self, tx: Any, args: Sequence[VariableTracker], kwargs: dict[str, VariableTracker]) -> VariableTracker:
        unimplemented(
            gb_type=f"dtcompile: {self.fn.__module__}.{self.fn.__qualname__} inside a compiled region",
            context=f"{self.fn.__qualname__}(...)",
            explanation=self.explanation,
            hints=self.hints,
        )


def graph_break(explanation: str, hints: list[str]) -> Handler:
    def handler(builder: Any, value: Any) -> VariableTracker:
        _guard_identity(builder)
        return GraphBreakFunctionVariable(value, explanation, hints)

    return handler


class StateContextVariable(ContextWrappingVariable):
    """``with cm():`` for a context manager that sets one global DTensor state.

    Entering sets the state at trace time (so Dynamo's own propagation sees it)
    and puts a call ``setter(value)`` into the graph, so AOTAutograd, which
    re-traces the graph, sees the same state between the same ops; exiting
    restores the value the state had when tracing started.  ``setter`` must be
    marked ``torch.fx.node.has_side_effect`` so dead-code elimination keeps it.
    """

    _nonvar_fields = {"setter", "cm_fn", *ContextWrappingVariable._nonvar_fields}  # noqa: RUF012 (Dynamo convention)

    def __init__(self, cm_fn: Callable[..., Any], setter: Callable[[Any], None], target: Any, initial: Any, **kwargs: Any) -> None:
        super().__init__(target_values=[target], initial_values=[initial], **kwargs)
        self.cm_fn = cm_fn
        self.setter = setter

    def enter(self, tx: Any) -> VariableTracker:
        self._call_func(tx, self.target_values)
        self.set_cleanup_hook(tx)
        return ConstantVariable.create(None)

    def _call_func(self, tx: Any, values: list[Any]) -> None:
        self.setter(values[0])
        tx.output.create_node("call_function", self.setter, (values[0],), {})

    def module_name(self) -> str:
        return self.cm_fn.__module__

    def fn_name(self) -> str:
        return self.cm_fn.__name__

    def reconstruct(self, codegen: Any) -> None:
        """On a graph break inside the block, the resumed code re-enters ``cm_fn()``."""
        codegen.add_push_null(lambda: self.reconstruct_type(codegen))
        codegen.extend_output(create_call_function(0, False))


class StateContextFunctionVariable(VariableTracker):
    """The context-manager function itself (``implicit_replication``); calling it makes the context."""

    def __init__(self, cm_fn: Callable[..., Any], setter: Callable[[Any], None], getter: Callable[[], Any], target: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cm_fn = cm_fn
        self.setter = setter
        self.getter = getter
        self.target = target

    def python_type(self) -> type:
        return type(self.cm_fn)

    def call_function(self, tx: Any, args: Sequence[VariableTracker], kwargs: dict[str, VariableTracker]) -> VariableTracker:
        if args or kwargs:
            unimplemented(
                gb_type=f"dtcompile: arguments to {self.cm_fn.__qualname__}",
                context=f"{args} {kwargs}",
                explanation=f"{self.cm_fn.__qualname__}() takes no arguments.",
                hints=[],
            )
        return StateContextVariable(self.cm_fn, self.setter, self.target, self.getter())


def state_context(setter: Callable[[Any], None], getter: Callable[[], Any], target: Any) -> Handler:
    def handler(builder: Any, value: Any) -> VariableTracker:
        _guard_identity(builder)
        return StateContextFunctionVariable(value, setter, getter, target)

    return handler
