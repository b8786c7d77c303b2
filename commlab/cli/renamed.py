"""Renamed options: the old spelling still works for a release, hidden from --help, with a warning
on stderr naming the new spelling (``--profile FILE`` is ``--calibration FILE`` now).

The warning is written here rather than with click's ``deprecated=`` (click 8.2 and later), since
commlab takes any click 8.
"""

from __future__ import annotations

import click


def add_old_spelling(command: click.Command, name: str, old: str) -> click.Command:
    """Give ``command``'s option ``name`` a hidden old spelling ``old`` that sets the same value;
    both spellings at once are a usage error."""
    option = next(p for p in command.params if p.name == name and isinstance(p, click.Option))
    new = max(option.opts, key=len)
    unset = (None, False)
    if option.callback is not None:
        raise ValueError(f"{new} has a callback of its own")

    def both(ctx: click.Context, value) -> None:
        if value not in unset and ctx.params.get(name) not in unset:
            raise click.UsageError(f"give {new} only ({old} is its old spelling)", ctx)

    def keep_old(ctx: click.Context, param: click.Parameter, value):
        # Given options are processed first, in command-line order: a value set through the old
        # spelling is kept when the new one was not given (its default would overwrite it).
        both(ctx, value)
        return ctx.params.get(name) if value in unset else value

    def set_new(ctx: click.Context, param: click.Parameter, value) -> None:
        if value in unset:
            return
        both(ctx, value)
        click.echo(f"warning: {old} is deprecated and goes in a later release: use {new}", err=True)
        ctx.params[name] = value

    option.callback = keep_old
    kind = {"is_flag": True} if option.is_flag else {"type": option.type}
    command.params.append(click.Option([old], hidden=True, expose_value=False, callback=set_new, **kind))
    return command
