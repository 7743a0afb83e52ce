"""The errors the OpenAI routes answer with: `OpenAIError` (an HTTP status and OpenAI's error
object, `{"error": {message, type, param, code}}`), and `bad_param` for a 400 naming a parameter.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpenAIError", "bad_param"]


class OpenAIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's clients parse."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def bad_param(param: str, message: str) -> OpenAIError:
    """A 400 naming the offending parameter: "<param>: <message>"."""
    return OpenAIError(400, f"{param}: {message}", param=param)
