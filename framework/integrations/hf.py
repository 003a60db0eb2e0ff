"""Where a run meets Hugging Face conventions: the one module that imports `transformers`
(with `framework.integrations.hf_models`, its model factories).

* What a model is: `is_hf_model` (a config and `save_pretrained`), `is_hf_model_class`,
  `predicts_next_token` (a causal LM shifts its labels itself), `hf_model_in` (a wrapper's one
  inner transformers model), `transformers_version`; `causal_lm_parts` (a causal LM as its
  backbone's hidden states and its output head, for a loss that applies the head itself).
* Models from files: `model_from_config_dir` (a `save_pretrained` directory's config.json, its
  architecture), `zero3_construction` (transformers' own ZeRO-3 path: `HfDeepSpeedConfig`).
* Tokenizers: `tokenizer_from` (a local directory or a `tokenizers` JSON file); a model loaded
  from a directory brings its tokenizer when the data names none (`tokenizer_dir`); data made
  with a tokenizer is checked against the model's vocabulary and classification labels become
  the model's `id2label` / `label2id` (`adopt`); the tokenizer's files are kept beside the
  checkpoints, where `export --hf` finds them (`keep_tokenizer`).
* Checkpoints: `save_model_config` keeps a model's config beside its weights (`HF_CONFIG`), so
  `python -m framework.export --hf` writes a `save_pretrained` directory.
* Attention: `register_attention` adds a function to transformers' attention registry (sequence
  parallelism's Ulysses attention).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from framework.errors import ConfigError
from framework.integrations import peft, peft_files

HF_CONFIG = "hf_config"  # a Hugging Face model's config.json, for `framework.export --hf`
HF_PREFIX = "weights_prefix"  # in HF_CONFIG: where the HF model sits in a wrapper's state dict ("lm.")


def save_model_config(module: Any, path: Path) -> None:
    """A Hugging Face model's config (and generation config) next to its weights, so an export
    can write a `save_pretrained` directory; for a wrapper, also where the model's weights are;
    for a `peft` model, the adapter's config (naming the base model) too."""
    if peft.is_adapted(module):  # what `export --adapter` and `--hf` rebuild the adapted model from
        peft_files.save_config(module, path)
    found = hf_model_in(module)
    if found is None:  # any torch module: its weights are all there is (an adapter's config, above)
        return
    prefix, model = found
    model.config.architectures = [type(model).__name__]  # what save_pretrained records, for from_pretrained
    model.config.save_pretrained(str(path / HF_CONFIG))
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "save_pretrained"):
        generation.save_pretrained(str(path / HF_CONFIG))
    if prefix:
        (path / HF_CONFIG / HF_PREFIX).write_text(prefix)


TOKENIZER_DIR = "tokenizer"  # in a checkpoints dir: the files of the tokenizer the run trained with
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_MODEL_DIR_KEYS = ("path", "pretrained_model_name_or_path")


def model_dir(model_node: Any) -> Path | None:
    """The `save_pretrained` directory a model config loads from (`path=` or
    `pretrained_model_name_or_path=`), if it names one that exists."""
    for key in _MODEL_DIR_KEYS:
        value = model_node.get(key) if hasattr(model_node, "get") else None
        if isinstance(value, str) and Path(value).expanduser().is_dir():
            return Path(value).expanduser()
    return None


def tokenizer_dir(model_node: Any) -> Path | None:
    """The model's directory when it holds a tokenizer's files, else None."""
    path = model_dir(model_node)
    return path if path is not None and any((path / f).is_file() for f in _TOKENIZER_FILES) else None


def is_hf_model(module: Any) -> bool:
    """A Hugging Face model: it has a config and can write a `save_pretrained` directory."""
    return hasattr(getattr(module, "config", None), "save_pretrained") and hasattr(module, "save_pretrained")


def is_hf_model_class(target: Any) -> bool:
    """True for a transformers model class (a `PreTrainedModel` subclass). A class whose module
    chain never imported transformers cannot be one: asked without importing it (~2 s of start-up)."""
    if not isinstance(target, type) or "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return issubclass(target, PreTrainedModel)


def transformers_version() -> str | None:
    """The installed transformers' version, None without one."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


@functools.cache  # per model class: asked on every batch that updates metrics
def _is_causal_lm(cls: type) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(base.__name__ in names for base in cls.__mro__)


def predicts_next_token(module: Any) -> bool:
    """True for a Hugging Face causal LM: given `labels=`, its logits at position t are scored
    against labels[t + 1] (it shifts them itself); seen through a `peft` wrapper."""
    return "transformers" in sys.modules and _is_causal_lm(peft.base_model(module).__class__)


# Config fields of causal LMs whose logits are more than the head of the last hidden state
# (Gemma 2's soft-capping, Cohere's scale, Granite's and MiniCPM's divisors, ...).
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
)


def causal_lm_parts(module: Any) -> tuple[Callable[..., Any], Any] | None:
    """(hidden states of a batch, output head) of a transformers causal LM, seen through a `peft`
    wrapper: `hidden(**inputs)` runs the model's backbone (`base_model`) on the inputs its forward
    takes and gives its last hidden state `[rows, positions, hidden]`, and the head
    (`get_output_embeddings()`) of that state is the model's logits. None for any other model,
    and for one whose config transforms its logits after the head (`_LOGIT_TRANSFORMS`)."""
    if not predicts_next_token(module):
        return None
    model = peft.base_model(module)
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)
    text = text_config() if callable(text_config) else config
    if any(getattr(text, name, None) is not None for name in _LOGIT_TRANSFORMS):
        return None
    backbone, head = getattr(model, "base_model", None), model.get_output_embeddings()
    if backbone is None or backbone is model or head is None:
        return None

    def hidden(**inputs: Any) -> Any:
        return backbone(**inputs).last_hidden_state

    return hidden, head


def hf_model_in(module: Any) -> tuple[str, Any] | None:
    """(prefix, model): the Hugging Face model `module` is, or the one sub-module that is (a wrapper
    around it); None when there is none, or several. A `peft` wrapper is seen through: its base
    model, with the prefix of its weights in the wrapper's state dict."""
    if peft.is_adapted(module):  # its base may be any torch module (LoRA on an MLP: no HF model)
        inner = hf_model_in(peft.base_model(module))
        return ("base_model.model." + inner[0], inner[1]) if inner is not None else None
    if is_hf_model(module):
        return "", module
    found = [(name, m) for name, m in module.named_modules() if name and is_hf_model(m)]
    outer = [(name, m) for name, m in found if not any(name.startswith(other + ".") for other, _ in found)]
    return (outer[0][0] + ".", outer[0][1]) if len(outer) == 1 else None


def _hf_model(module: Any) -> Any:
    module = peft.base_model(module)
    if is_hf_model(module):
        return module
    return next((m for m in module.modules() if is_hf_model(m)), None)


def model_from_config_dir(path: Path, strict: bool = True) -> Any:
    """The model a `save_pretrained` directory's config.json describes (its first architecture),
    with fresh weights; `strict=False` falls back to `AutoModel` for an unknown architecture."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    name = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, str(name), None)
    if cls is None or name == "AutoModel":
        if strict:
            raise ConfigError(f"{path}: transformers has no model class {name!r} (from its config.json)")
        return transformers.AutoModel.from_config(config)
    return cls(config)


def pretrained(path: Path, like: Any) -> Any:
    """The model of a `save_pretrained` directory, of the class of `like` (its weights loaded)."""
    return type(like).from_pretrained(str(path), local_files_only=True)


@contextlib.contextmanager
def zero3_construction(zero_config: dict[str, Any]) -> Iterator[None]:
    """Transformers' own ZeRO-3 path while the block runs: its models built (or loaded) inside it
    are born partitioned, initialised by transformers (`HfDeepSpeedConfig`, held weakly by it)."""
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(zero_config)
    try:
        yield
    finally:
        del keep_alive  # ZeRO-3 construction ends here


def zero3_enabled() -> bool:
    """True inside `zero3_construction` (transformers builds its models partitioned there)."""
    if "transformers" not in sys.modules:
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def register_attention(
    name: str, core: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Add `name` to transformers' attention registry (once per process): `wrap` of the library's
    function `core`, with the masks `core` uses. A model uses it with `config._attn_implementation = name`."""
    from transformers import AttentionInterface, AttentionMaskInterface

    registry = AttentionInterface()  # a fresh instance: the library-wide functions
    if name not in registry:
        AttentionInterface.register(name, wrap(registry[core]))
        AttentionMaskInterface.register(name, AttentionMaskInterface()[core])


def tokenizer_from(path: Path) -> Any:
    """A tokenizer from a local directory (`AutoTokenizer`) or a `tokenizers` JSON file."""
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path))


def check_vocabulary(model: Any, tokenizer: Any) -> None:
    """A tokenizer that gives ids past the model's embedding is a one-line error naming both sizes."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    size = len(tokenizer)
    if isinstance(vocab, int) and size > vocab:
        raise ConfigError(
            f"the tokenizer has {size} tokens but {type(model).__name__}'s vocabulary has {vocab} "
            f"(config.vocab_size): ids >= {vocab} would index past its embedding; use the model's own "
            "tokenizer (data.dataset.tokenizer=DIR) or a model with a vocabulary of at least "
            f"{size}"
        )


def set_labels(model: Any, labels: list[str]) -> None:
    """The data's class names as the model's `id2label` / `label2id` (saved with its config); a
    model with another number of classes is a one-line error."""
    config = model.config
    count = int(getattr(config, "num_labels", 0))
    named = labels != [str(i) for i in range(len(labels))]
    if count < len(labels) or (named and count != len(labels)):
        raise ConfigError(
            f"the data has {len(labels)} classes ({', '.join(labels[:5])}{', ...' if len(labels) > 5 else ''}) "
            f"but {type(model).__name__} has num_labels={count}: set model.num_labels={len(labels)}"
        )
    if named:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: i for i, name in enumerate(labels)}


def adopt(module: Any, splits: Any) -> None:
    """Check the data's tokenizer against the model and give it the data's class names (see the
    module doc); nothing for a model that is not a Hugging Face one, or data without them."""
    model = _hf_model(module)
    if model is None:
        return
    tokenizer = getattr(splits, "tokenizer", None)
    if tokenizer is not None:
        check_vocabulary(model, tokenizer)
    labels = getattr(splits, "labels", None)
    if labels is not None:
        set_labels(model, labels)


def keep_tokenizer(splits: Any, ckpt_dir: Path, write: bool = True) -> Path | None:
    """The data's tokenizer (one that has files: `save_pretrained`) into `ckpt_dir/tokenizer`,
    for `export --hf` (written where `write`: rank 0)."""
    tokenizer = getattr(splits, "tokenizer", None)
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        return None
    out = ckpt_dir / TOKENIZER_DIR
    if write:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
    return out
