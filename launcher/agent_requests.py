"""The requests the SSH agent takes (docs/CONTRACTS.md, "SSH backend <-> remote agent"), one typed dict per mode.

pydantic checks them (strict: JSON's true is no number, "4" no integer; a field not listed is refused). Each
field's description is what it must be, quoted when it is not; messages name fields, never values (a request's
`env` holds secrets). pydantic is in the trainer environment the agent runs in (docker/requirements-trainer.txt).
"""

from __future__ import annotations

import typing
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, with_config
from pydantic.fields import FieldInfo
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

from core.protocol import RUN_KEY_PATTERN

_STRICT = ConfigDict(strict=True, extra="forbid", regex_engine="python-re")


class BadRequest(ValueError):
    """The JSON line on stdin is missing, malformed or has a field of the wrong kind."""


Strings = Annotated[list[str], Field(description="a list of strings")]
Seconds = Annotated[float, Field(ge=0, le=3600, description="seconds, 0 to 3600")]
Directory = Annotated[str, Field(min_length=1, description="a directory path")]
GroupName = Annotated[str, Field(min_length=1, description="a worker group's name")]
RunKey = Annotated[str, Field(pattern=rf"\A(?:{RUN_KEY_PATTERN.pattern})\Z",  # it names a directory on the host
                              description="a run key (letters, digits, '.', '_', '-'; not starting with '.')")]
IdleLevels = Annotated[dict[str, Annotated[int, Field(ge=0)]],
                       Field(description="an object mapping GPU UUIDs or indices to idle levels in whole MiB")]
Gpus = Annotated[list[str], Field(description="a list of GPU UUIDs or indices")]
UseGpu = Annotated[bool, Field(description="true or false")]
_EnvName = Annotated[str, Field(pattern=r"^[^=\x00]+$")]
_EnvText = Annotated[str, Field(pattern=r"^[^\x00]*$")]


@with_config(_STRICT)
class RunRequest(TypedDict):
    argv: Annotated[list[str], Field(min_length=1, description="a non-empty list of strings")]
    env: Annotated[dict[_EnvName, _EnvText], Field(description="an object mapping variable names to strings")]
    cwd: Directory
    grace_s: Seconds
    base_env: Annotated[Literal["inherit"], Field(description='"inherit"')]


@with_config(_STRICT)
class ProbeRequest(TypedDict):
    ports: Annotated[int, Field(ge=0, le=1024, description="a whole number 0 to 1024")]
    workdir: Directory
    use_gpu: UseGpu


@with_config(_STRICT)
class ReleaseRequest(TypedDict):
    run_key: RunKey
    grace_s: Seconds
    workdir: Annotated[Directory | None, Field(description="a directory path or null")]
    idle_mb: IdleLevels


@with_config(_STRICT)
class KillRequest(TypedDict):
    pgid: Annotated[int, Field(description="a process group id")]
    run_key: RunKey


@with_config(_STRICT)
class ReapRequest(TypedDict):
    run_key: RunKey
    group: GroupName
    grace_s: Seconds


@with_config(_STRICT)
class SlotsRequest(TypedDict):
    run_key: RunKey
    group: GroupName
    pids: Annotated[list[Annotated[int, Field(gt=0)]], Field(description="a list of pids")]
    gpus: Gpus
    idle_mb: IdleLevels
    use_gpu: UseGpu


@with_config(_STRICT)
class UtilizationRequest(TypedDict):
    gpus: Gpus


REQUESTS: dict[str, type] = {"run": RunRequest, "probe": ProbeRequest, "release": ReleaseRequest,
                             "kill": KillRequest, "reap": ReapRequest, "slots": SlotsRequest,
                             "utilization": UtilizationRequest}


@cache
def _adapter(mode: str) -> TypeAdapter[Any]:
    return TypeAdapter(REQUESTS[mode])


def _wanted(mode: str) -> dict[str, str]:
    """Each field's description: what it must be."""
    hints = typing.get_type_hints(REQUESTS[mode], include_extras=True)
    return {name: next(item.description for item in reversed(hint.__metadata__)
                       if isinstance(item, FieldInfo) and item.description) for name, hint in hints.items()}


def checked_request(mode: str, request: dict[str, Any]) -> dict[str, Any]:
    """The `mode` request `request` (a JSON object), checked; BadRequest naming the first wrong field otherwise."""
    try:
        return _adapter(mode).validate_python(request)
    except ValidationError as error:
        raise _refusal(mode, request, error) from None


def _refusal(mode: str, request: dict[str, Any], error: ValidationError) -> BadRequest:
    wanted = _wanted(mode)
    wrong = [f"{what} fields {names}" for what, names in (("unknown", sorted(set(request) - set(wanted))),
                                                          ("missing", sorted(set(wanted) - set(request)))) if names]
    if wrong:
        return BadRequest(f"the {mode} request has {' and '.join(wrong)}; expected exactly {sorted(wanted)}")
    name = str(error.errors(include_input=False)[0]["loc"][0])
    return BadRequest(f"the {mode} request's {name!r} must be {wanted[name]}")
