"""The shapes chat and pairs data come in, told from a file's first row and said in one line
(`data: ShareGPT conversations (conversations: from/value) in chat.jsonl`), each turned into
chat messages (`{"role", "content"}`) or plain text:

* `messages`: `{"messages": [{"role", "content"}, ...]}` (OpenAI's and TRL's conversational shape);
* `sharegpt`: `{"conversations": [{"from", "value"}, ...]}`, roles as LLaMA-Factory maps them
  (`human` -> user, `gpt` -> assistant, `system`, `observation` / `tool` -> tool, `function_call`
  -> an assistant tool call parsed from its JSON); a `system` column is the system turn;
* `alpaca`: `{"instruction", "input", "output"}`: the user turn is the instruction, then a blank
  line and the input when there is one; the output is the assistant's; a `system` column the
  system turn, a `history` column of [user, assistant] pairs the turns before;
* `prompt_completion` (TRL's): `{"prompt", "completion"}`, both chat messages (the loss on the
  completion) or both strings (plain text, no template; the loss on the completion's tokens);
* pairs (`data=hf_preference`): `framework.data.datasets.preference.PairFormat`, its messages
  read as here.

`data.dataset.format` sets the shape; `columns` renames the columns a shape reads,
`message_keys` a message's keys (`{role: from, content: value}`) and `roles` maps a role to the
names the file gives it (`{assistant: [gpt, bot]}`). Content given as a list of OpenAI parts
(`[{"type": "text", "text": ...}]`) is its text parts joined; another part type, or a message
without content (but for an assistant's tool calls), is one line naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from framework.errors import ConfigError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion")
COLUMNS = ("system", "tools", "instruction", "input", "output", "history", "prompt", "completion")
TEXT_PARTS = ("text", "input_text", "output_text")
ROLES = ("system", "user", "assistant", "tool", "function_call")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "observation": "tool",
    "tool": "tool",
    "function_call": "function_call",  # an assistant's tool call, its JSON in `value`
}
NAMES = {
    "messages": "chat messages",
    "sharegpt": "ShareGPT conversations",
    "alpaca": "Alpaca rows",
    "prompt_completion": "prompt-completion rows",
}


@dataclass
class Sample:
    """A row made ready to tokenize: chat `messages` (the first `prompt` of them a prompt whose
    completion alone is learned, None: every assistant turn is), or plain `text` (prompt,
    completion); `tools` for the chat template."""

    messages: list[dict[str, Any]] | None = None
    prompt: int | None = None
    text: tuple[str, str] | None = None
    tools: Any = None


@dataclass
class Reading:
    """How rows are read: the data.dataset keys `format`, `messages_column`, `columns`,
    `message_keys` and `roles` (see the module doc)."""

    format: str | None = None
    messages_column: str | None = None
    columns: dict[str, str] = field(default_factory=dict)
    message_keys: dict[str, str] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # the file's name -> role

    @classmethod
    def of(
        cls,
        format: Any = None,
        messages_column: Any = None,
        columns: Any = None,
        message_keys: Any = None,
        roles: Any = None,
    ) -> Reading:
        """The options as the config gives them (mappings whose unset entries are null)."""
        if format is not None and format not in FORMATS:
            raise ConfigError(
                f"data.dataset.format={format}: one of {', '.join(FORMATS)} (null: told from the rows)"
            )
        named = {k: str(v) for k, v in dict(columns or {}).items() if v is not None}
        unknown = sorted(set(named) - set(COLUMNS))
        if unknown:
            raise ConfigError(
                f"data.dataset.columns.{unknown[0]}: not a column a format reads ({', '.join(COLUMNS)})"
            )
        keys = {k: str(v) for k, v in dict(message_keys or {}).items() if v is not None}
        if set(keys) - {"role", "content"}:
            raise ConfigError("data.dataset.message_keys: name `role` and `content` only")
        names: dict[str, str] = {}
        for role, given in dict(roles or {}).items():
            if role not in ROLES:
                raise ConfigError(f"data.dataset.roles.{role}: a role is one of {', '.join(ROLES)}")
            for name in [given] if isinstance(given, str) else list(given or []):
                names[str(name)] = str(role)
        return cls(format, messages_column, named, keys, names)

    def column(self, name: str) -> str:
        """The file's name of the column a format reads as `name`."""
        return self.columns.get(name, name)

    def key(self) -> str:
        """What the options are, for a cache key."""
        return json.dumps(
            [self.format, self.messages_column, self.columns, self.message_keys, self.roles], sort_keys=True
        )


class ChatFormat:
    """The format of a chat file (`name`, its messages in `column`), turning its rows into
    `Sample`s (picklable: a stream's reader gets its encoder so)."""

    def __init__(self, name: str, reading: Reading, column: str | None = None):
        self.name, self.reading = name, reading
        self.column = (
            column or reading.messages_column or ("conversations" if name == "sharegpt" else "messages")
        )
        sharegpt = name == "sharegpt"
        self.role_key = reading.message_keys.get("role", "from" if sharegpt else "role")
        self.content_key = reading.message_keys.get("content", "value" if sharegpt else "content")
        self.roles = {**(SHAREGPT_ROLES if sharegpt else {}), **reading.roles}

    def describe(self, path: Any, row: dict[str, Any]) -> str:
        """The one line that says how a file is read."""
        what = NAMES[self.name]
        if self.name in ("messages", "sharegpt"):
            what += f" ({self.column}: {self.role_key}/{self.content_key})"
        elif self.name == "alpaca":
            what += f" ({'/'.join(self.reading.column(c) for c in ('instruction', 'input', 'output'))})"
        else:
            plain = isinstance(row.get(self.reading.column("prompt")), str)
            what += (
                " (plain text, no template: loss on the completion's tokens)"
                if plain
                else " (chat messages: loss on the completion)"
            )
        return f"data: {what} in {path}"

    def key(self) -> str:
        """What the format is, for a cache key."""
        return json.dumps([self.name, self.column, self.reading.key()])

    def sample(self, row: dict[str, Any], where: str) -> Sample:
        """The row as a `Sample`, or a one-line error naming `where`."""
        if self.name == "alpaca":
            return Sample(
                self._system(row, where) + alpaca_messages(row, where, self.reading),
                tools=self._tools(row, where),
            )
        if self.name == "prompt_completion":
            return self._prompt_completion(row, where)
        raw = row.get(self.column)
        if raw is None:
            present = sorted(k for k, v in row.items() if v is not None and not k.startswith("__"))
            raise ConfigError(
                f"{where}: no '{self.column}' in the row (it has {present}); "
                "data.dataset.messages_column=NAME names the conversations (data.dataset.format another shape)"
            )
        messages = self.messages(raw, where, self.column)
        return Sample(self._system(row, where, messages) + messages, tools=self._tools(row, where))

    def messages(self, raw: Any, where: str, column: str) -> list[dict[str, Any]]:
        """A list of messages of this format as `{"role", "content", ...}` dicts, checked."""
        if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
            raise ConfigError(
                f"{where}: '{column}' must be a list of {{{self.role_key}, {self.content_key}}} messages, "
                f"not {type(raw).__name__}"
            )
        return [self._message(m, j, where) for j, m in enumerate(raw)]

    def _message(self, message: dict[str, Any], j: int, where: str) -> dict[str, Any]:
        role = message.get(self.role_key)
        if not isinstance(role, str):
            raise ConfigError(
                f"{where}: message {j} has {self.role_key} {role!r}; a role is a string (system, user, assistant, ...)"
                + ("" if self.role_key in message else "; data.dataset.message_keys.role names the key")
            )
        out = {
            k: v for k, v in message.items() if v is not None and k not in (self.role_key, self.content_key)
        }
        role = self.roles.get(role, role)
        content = text_of(message.get(self.content_key), where, j)
        if role == "function_call":
            role, content, out["tool_calls"] = "assistant", "", tool_calls(content, where, j)
        if content is None and not out.get("tool_calls"):
            raise ConfigError(
                f"{where}: message {j} ({role}) has no {self.content_key}; give its text (an assistant turn "
                "without content would be learned as an empty answer), or remove the message"
            )
        return {"role": role, "content": content, **out}

    def _system(
        self, row: dict[str, Any], where: str, messages: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """The system turn a `system` column gives, unless the messages begin with one."""
        system = row.get(self.reading.column("system"))
        if system is None or system == "" or (messages and messages[0]["role"] == "system"):
            return []
        if not isinstance(system, str):
            raise ConfigError(
                f"{where}: '{self.reading.column('system')}' must be a string, not {type(system).__name__}"
            )
        return [{"role": "system", "content": system}]

    def _tools(self, row: dict[str, Any], where: str) -> Any:
        tools = row.get(self.reading.column("tools"))
        if isinstance(tools, str):
            try:
                return json.loads(tools) if tools.strip() else None
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{where}: '{self.reading.column('tools')}' is not JSON ({exc.msg})"
                ) from None
        return tools or None

    def _prompt_completion(self, row: dict[str, Any], where: str) -> Sample:
        keys = (self.reading.column("prompt"), self.reading.column("completion"))
        prompt, completion = (row.get(k) for k in keys)
        if prompt is None or completion is None:
            present = sorted(k for k, v in row.items() if v is not None and not k.startswith("__"))
            raise ConfigError(
                f"{where}: a prompt-completion row needs '{keys[0]}' and '{keys[1]}' (it has {present})"
            )
        if isinstance(prompt, str) and isinstance(completion, str):
            return Sample(text=(prompt, completion))
        head = self._system(row, where) + self.as_messages(prompt, "user", where, keys[0])
        tail = self.as_messages(completion, "assistant", where, keys[1])
        return Sample(head + tail, prompt=len(head), tools=self._tools(row, where))

    def as_messages(self, value: Any, role: str, where: str, column: str) -> list[dict[str, Any]]:
        """A string as one `role` message; a message, or a list of them, checked."""
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        return self.messages([value] if isinstance(value, dict) else value, where, column)


def text_of(content: Any, where: str, j: int) -> str | None:
    """A message's content as text: a string as it is; a list of OpenAI content parts as its text
    parts joined (as a chat template renders them, one after the other); None when there is none."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConfigError(
            f"{where}: message {j}'s content is a {type(content).__name__}, not text or a list of parts"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ConfigError(
                f"{where}: message {j} holds a content part of type {kind!r}; only text parts "
                '({"type": "text", "text": ...}) can be trained on: remove the others'
            )
        texts.append(part["text"])
    return "".join(texts) if texts else None


def tool_calls(content: Any, where: str, j: int) -> list[dict[str, Any]]:
    """A ShareGPT `function_call` message's JSON (a call `{"name", "arguments"}` or a list of
    them) as chat-template tool calls."""
    try:
        calls = json.loads(content) if isinstance(content, str) else None
    except json.JSONDecodeError:
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if (
        not isinstance(calls, list)
        or not calls
        or not all(isinstance(c, dict) and "name" in c for c in calls)
    ):
        raise ConfigError(
            f'{where}: message {j} (function_call) is not the JSON of a call {{"name": ..., "arguments": ...}} '
            "or a list of them"
        )
    return [
        {"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
        for c in calls
    ]


def alpaca_messages(row: dict[str, Any], where: str, reading: Reading) -> list[dict[str, Any]]:
    """An Alpaca row's turns: its history's [user, assistant] pairs, then the instruction (and,
    after a blank line, the input) as the user's and the output as the assistant's."""
    names = [reading.column(c) for c in ("instruction", "input", "output", "history")]
    instruction, given, output, history = (row.get(n) for n in names)
    for name, value in ((names[0], instruction), (names[2], output)):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: an Alpaca row needs a string '{name}' (got {type(value).__name__})")
    if given is not None and not isinstance(given, str):
        raise ConfigError(f"{where}: '{names[1]}' must be a string, not {type(given).__name__}")
    turns: list[dict[str, Any]] = []
    for pair in history or []:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise ConfigError(f"{where}: '{names[3]}' must be a list of [user, assistant] string pairs")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = str(instruction) + (f"\n\n{given}" if given else "")
    return [*turns, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def chat_format(row: dict[str, Any], reading: Reading, where: str) -> ChatFormat:
    """The format of a chat file, from its first row `row` (or `reading.format`)."""
    if reading.format is not None:
        return ChatFormat(reading.format, reading)
    candidates = [reading.messages_column] if reading.messages_column else ["messages", "conversations"]
    for column in candidates:
        value = row.get(column)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return ChatFormat("sharegpt" if sharegpt_keys(value[0], reading) else "messages", reading, column)
    if reading.column("instruction") in row and reading.column("output") in row:
        return ChatFormat("alpaca", reading)
    if reading.column("prompt") in row and reading.column("completion") in row:
        return ChatFormat("prompt_completion", reading)
    if "chosen" in row and "rejected" in row:
        raise ConfigError(
            f"{where}: these rows are preference pairs (chosen/rejected): use data=hf_preference"
        )
    present = sorted(k for k in row if not k.startswith("__"))
    raise ConfigError(
        f"{where}: cannot tell the rows' format from their columns {present}: name it with "
        f"data.dataset.format ({', '.join(FORMATS)}) or the conversations' column with data.dataset.messages_column"
    )


def sharegpt_keys(message: dict[str, Any], reading: Reading) -> bool:
    """A message of ShareGPT's keys (`from` / `value`), unless `message_keys` say otherwise."""
    role_key = reading.message_keys.get("role")
    return role_key == "from" if role_key else "from" in message and "role" not in message
