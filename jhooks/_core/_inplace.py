"""The guided error for an in-place edit in a hook: `z[:, :, 1] = 0` on a JAX array.

JAX refuses it with a `TypeError` ("JAX arrays are immutable..."), naming no hook. The
guided error (`_guide.py`) names the hook and its point, and spells the statement the
hook wrote functionally, read from its source line: `z = z.at[:, :, 1].set(0)`, then
`return z` (a hook's value replaces the point's only when it is returned).
"""

from __future__ import annotations

import ast
import linecache
import os
from types import TracebackType

import jax

# Where JAX's own frames are: the statement is in the last frame outside them.
_JAX_DIRS = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (jax,))

# `z[i] op= v` as `z.at[i].method(v)`; `-=` adds the negation.
_METHODS = {ast.Add: "add", ast.Sub: "add", ast.Mult: "multiply", ast.Div: "divide"}
_METHODS[ast.Pow] = "power"


def is_in_place(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of `x[idx] = y` on an array or a tracer."""
    text = str(error)
    return isinstance(error, TypeError) and "immutable" in text and ".at[" in text


def in_place_message(who: str, error: BaseException) -> str:
    """The guided message: `who` (`"hook f at hook point 'z'"`) edited its value in
    place; the functional spelling of the statement, and JAX's first line."""
    jax_error = _innermost(error)
    line = _statement(jax_error.__traceback__)
    spelled = None if line is None else functional(line)
    wrote, rewrite, name = "", "x = x.at[idx].set(y)", "x"
    if spelled is not None:
        statement, rewrite, name = spelled
        wrote = f" (`{statement}`)"
    if not name.isidentifier():  # `out[0][i] = v`: the new array, for the output to hold
        returned = f"`{rewrite}`, and return the output with that array in place of `{name}`"
    else:
        returned = f"`{rewrite}`, and return the new array, `return {name}`"
    lines = str(jax_error).strip().splitlines()
    return (
        f"{who} edited an array in place{wrote}: JAX arrays are immutable (a hook may be "
        "given a traced value, and the value it is given is the model's too). Write the "
        f"edit functionally, {returned}: what a hook returns replaces the value it was "
        f"given. JAX said: {type(jax_error).__name__}: {lines[0] if lines else ''}"
    )


def _innermost(error: BaseException) -> BaseException:
    """JAX's own refusal among `error` and the errors it was raised from (a hook's error
    that a wrapper re-raised with more to say): its traceback ends at the statement."""
    found, seen, cause = error, set(), error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if is_in_place(cause):
            found = cause
        cause = cause.__cause__ or cause.__context__
    return found


def functional(statement: str) -> tuple[str, str, str] | None:
    """`("z[:, :, 1] = 0", "z = z.at[:, :, 1].set(0)", "z")` for the statement
    `z[:, :, 1] = 0` (`+=`: `.add`, and so on): the statement as parsed, written
    functionally, and the array edited; for an array that is not a name (`out[0][i] = 1`),
    the new array's expression (`out[0].at[i].set(1)`) and the array (`out[0]`); `None`
    for any other statement."""
    try:
        body = ast.parse(statement).body
    except SyntaxError:
        return None
    if len(body) != 1:
        return None
    (node,) = body
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target, method, value = node.targets[0], "set", ast.unparse(node.value)
    elif isinstance(node, ast.AugAssign) and type(node.op) in _METHODS:
        target, method, value = node.target, _METHODS[type(node.op)], ast.unparse(node.value)
        if isinstance(node.op, ast.Sub):
            simple = isinstance(node.value, ast.Name | ast.Constant | ast.Attribute)
            value = f"-{value}" if simple else f"-({value})"
    else:
        return None
    if not isinstance(target, ast.Subscript):
        return None
    base = ast.unparse(target.value)
    index = ast.unparse(target)[len(base) + 1 : -1]
    new = f"{base}.at[{index}].{method}({value})"
    if not isinstance(target.value, ast.Name):
        return ast.unparse(node), new, base
    return ast.unparse(node), f"{base} = {new}", base


def _statement(tb: TracebackType | None) -> str | None:
    """The source line of the last frame of `tb` outside JAX (the hook's statement that
    assigned), or `None` where its source is not available."""
    last = None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_JAX_DIRS):
            last = tb
        tb = tb.tb_next
    if last is None:
        return None
    line = linecache.getline(last.tb_frame.f_code.co_filename, last.tb_lineno).strip()
    return line or None
