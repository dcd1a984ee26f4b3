"""Random-weight checkpoints in exact Hugging Face format, for tests and benchmarks.

No weights can be downloaded, so presets are generated: a byte-level BPE tokenizer
trained on a generated English-like corpus, and a Llama model whose random weights
are scaled so that greedy generation wanders through many tokens (a std-0.02 init
repeats one token forever, which would make token-equality tests meaningless).
Everything is deterministic for a given (preset, seed).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from fastserve.model.tokenizer import DEFAULT_CHAT_TEMPLATE
from fastserve.paths import cache_dir

# --------------------------------------------------------------------------- corpus

# The tokenizer corpus: sentences drawn from common English words (Zipf-weighted,
# so frequent words become single tokens) mixed with pronounceable made-up words
# (so BPE has enough distinct pieces to reach a large vocabulary), numbers,
# punctuation and a little non-ASCII text.
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
measure door product black short numeral class wind question happen complete ship area half rock
order fire south problem piece told knew pass since top whole king space heard best hour better
true during hundred five remember step early hold west ground interest reach fast verb sing listen
six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct
able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
course stay wheel full force blue object decide surface deep moon island foot system busy test
record boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape
equate miss brought heat snow tire bring yes distant fill east paint language among grand ball yet
wave drop heart present heavy dance engine position arm wide sail material size vary settle speak
weight general ice matter circle pair include divide syllable felt perhaps pick sudden count
square reason length represent art subject region energy hunt probable bed brother egg ride cell
believe fraction forest sit race window store summer train sleep prove lone exercise wall catch
mount wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign
visit past soft fun bright gas weather month million bear finish happy hope flower clothe strange
gone jump baby eight village meet root buy raise solve metal whether push seven paragraph third
shall held hair describe cook floor either result burn hill safe cat century consider type law bit
coast copy phrase silent tall sand soil roll temperature finger industry value fight lie beat
excite natural view sense ear else quite broke case middle kill son lake moment scale loud spring
observe child straight consonant nation dictionary milk speed method organ pay age section dress
cloud surprise quiet stone tiny climb cool design poor lot experiment bottom key iron single stick
flat twenty skin smile crease hole trade melody trip office receive row mouth exact symbol die
least trouble shout except wrote seed tone join suggest clean break lady yard rise bad blow oil
blood touch grew cent mix team wire cost lost brown wear garden equal sent choose fell fit flow
fair bank collect save control decimal gentle woman captain practice separate difficult doctor
please protect noon whose locate ring character insect caught period indicate radio spoke atom
human history effect electric expect crop modern element hit student corner party supply bone
rail imagine provide agree thus capital chair danger fruit rich thick soldier process operate
guess necessary sharp wing create neighbor wash bat rather crowd corn compare poem string bell
depend meat rub tube famous dollar stream fear sight thin triangle planet hurry chief colony clock
mine tie enter major fresh search send yellow gun allow print dead spot desert suit current lift
rose arrive master track parent shore division sheet substance favor connect post spend chord fat
glad original share station dad bread charge proper bar offer segment slave duck instant market
degree populate chick dear enemy reply drink occur support speech nature range steam motion path
liquid log meant quotient teeth shell neck oxygen sugar death pretty skill women season solution
magnet silver thank branch match suffix especially fig afraid huge sister steel discuss forward
similar guide experience score apple bought led pitch coat mass card band rope slip win dream
evening condition feed tool total basic smell valley nor double seat continue block chart hat sell
success company subtract event particular deal swim term opposite wife shoe shoulder spread
arrange camp invent cotton born determine quart nine truck noise level chance gather shop stretch
throw shine property column molecule select wrong gray repeat require broad prepare salt nose
plural anger claim continent model server request token cache memory engine schedule queue batch
"""

_ONSETS = "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp st str th tr".split()
_VOWELS = "a e i o u ai ea ee ie oa oo ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rk", "x"]
_SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly", "tion", "ness", "ment", "able"]
_PUNCT = [".", ".", ".", ",", ",", "!", "?", ";", ":"]
_NON_ASCII = [
    "café",
    "naïve",
    "über",
    "señor",
    "façade",
    "héllo",
    "wörld",
    "你好",
    "世界",
    "日本語",
    "🙂",
    "🚀",
    "€",
    "—",
]


def _made_up_words(rng: random.Random, count: int) -> list[str]:
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        words.add(word + rng.choice(_SUFFIXES))
    return sorted(words)


def generate_corpus(num_sentences: int, num_made_up_words: int, seed: int = 0) -> list[str]:
    """`num_sentences` lines of text; the same arguments always give the same text."""
    rng = random.Random(seed)
    common = _COMMON_WORDS.split()
    vocab = common + _made_up_words(rng, num_made_up_words)
    # Zipf weights: the head of the list (common words first) dominates the text.
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.9 for rank in range(len(vocab))))
    lines = []
    for _ in range(num_sentences):
        words = rng.choices(vocab, cum_weights=cum_weights, k=rng.randint(4, 18))
        words[0] = words[0].capitalize()
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10_000)))
        if rng.random() < 0.05:
            words.insert(rng.randrange(len(words)), rng.choice(_NON_ASCII))
        if rng.random() < 0.15:
            i = rng.randrange(len(words))
            words[i] += ","
        lines.append(" ".join(words) + rng.choice(_PUNCT))
    return lines


# --------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    """Shape of a generated model and of the corpus its tokenizer is trained on."""

    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    target_vocab_size: int  # BPE target; the model gets what the tokenizer actually has
    dtype: str  # safetensors dtype, also written as config.json's torch_dtype
    num_sentences: int  # tokenizer corpus size; enough distinct words to reach the target
    num_made_up_words: int
    max_position_embeddings: int = 2048
    # The model's vocabulary when larger than the tokenizer's (the rows past the tokenizer's
    # ids are never produced by encoding, as Llama 3's reserved tokens); 0 = the tokenizer's.
    model_vocab_size: int = 0
    rope_theta: float = 10000.0
    # Whether `make-model` writes weights by default: a production shape's 13-16 GB of random
    # numbers is better made on the device at load time (`--load-format dummy`).
    write_weights: bool = True
    architecture: str = "llama"  # a key of ARCHITECTURES
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    # Sparse MoE (architectures mixtral, qwen3-moe): experts per layer, chosen per token, and
    # each expert's intermediate size (mixtral's is intermediate_size). qwen3-moe's layers in
    # mlp_only_layers keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # qwen2-moe's shared expert


# A preset's architecture: config.json's "architectures" and "model_type". A qwen3 checkpoint
# also gets the q_norm and k_norm weights of each layer, a mixtral or qwen3-moe one a router
# and experts in place of the MLP (`random_weights`), each in its hub checkpoints' names.
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
}

PRESETS: dict[str, Preset] = {
    # 4 layers, GQA (8 query heads over 4 kv heads), untied: ~5.0M params, float32.
    "tiny": Preset(4, 256, 688, 8, 4, False, 4096, "float32", 10_000, 3_000),
    # 12 layers, MHA, tied, Llama-2-sized vocabulary: ~110M params, bfloat16.
    "small": Preset(12, 768, 2048, 12, 12, True, 32_000, "bfloat16", 40_000, 30_000),
    # Production shapes, served with `--load-format dummy` (config.json and tokenizer only).
    # Llama-2-7B: 32 layers, 4096 hidden, 11008 MLP, 32 heads (MHA), vocab 32000: 6.7B params.
    "llama-2-7b": Preset(32, 4096, 11008, 32, 32, False, 32_000, "bfloat16", 40_000, 30_000,
                         max_position_embeddings=4096, model_vocab_size=32_000,
                         write_weights=False),
    # Llama-3-8B: 32 layers, 4096 hidden, 14336 MLP, 32 query heads over 8 kv heads (GQA),
    # vocab 128256 (the tokenizer here has ~32k of them), rope theta 500000: 8.0B params.
    "llama-3-8b": Preset(32, 4096, 14336, 32, 8, False, 32_000, "bfloat16", 40_000, 30_000,
                         max_position_embeddings=8192, model_vocab_size=128_256,
                         rope_theta=500000.0, write_weights=False),
    # tiny as a Qwen3: its q/k norms, and heads of 64 (8 x 64 = 512 wide q against 256 hidden).
    "tiny-qwen3": Preset(4, 256, 688, 8, 4, False, 4096, "float32", 10_000, 3_000,
                         architecture="qwen3", head_dim=64),
    # Qwen3-8B: 36 layers, 4096 hidden, 12288 MLP, 32 query heads over 8 kv heads of 128,
    # vocab 151936 (the tokenizer here has ~32k of them), rope theta 1e6: 8.2B params.
    "qwen3-8b": Preset(36, 4096, 12288, 32, 8, False, 32_000, "bfloat16", 40_000, 30_000,
                       max_position_embeddings=40960, model_vocab_size=151_936,
                       rope_theta=1_000_000.0, write_weights=False, architecture="qwen3",
                       head_dim=128),
    # tiny as a Mixtral: 8 experts of 344 per layer, 2 per token (~8.6M params).
    "tiny-mixtral": Preset(4, 256, 344, 8, 4, False, 4096, "float32", 10_000, 3_000,
                           architecture="mixtral", num_experts=8, num_experts_per_tok=2),
    # tiny-qwen3 with Qwen3-MoE's experts: 16 of 128 per layer, 4 per token, renormalised;
    # layer 3 keeps a dense MLP (mlp_only_layers), which Qwen's configs allow.
    "tiny-qwen3-moe": Preset(4, 256, 688, 8, 4, False, 4096, "float32", 10_000, 3_000,
                             architecture="qwen3-moe", head_dim=64, num_experts=16,
                             num_experts_per_tok=4, moe_intermediate_size=128,
                             mlp_only_layers=(3,)),
    # small's attention and vocabulary with 8 experts of 1024 a layer, 2 per token: ~280M
    # params, ~110M of them active per token (the dense small's 125M): for CPU benchmarks.
    "small-mixtral": Preset(12, 768, 1024, 12, 12, True, 32_000, "bfloat16", 40_000, 30_000,
                            architecture="mixtral", num_experts=8, num_experts_per_tok=2),
    # tiny with Qwen2-MoE's experts: q/k/v biases, 8 experts of 128 a layer, 2 per token (not
    # renormalised), and a shared expert of 256 every token runs, gated by a sigmoid.
    "tiny-qwen2-moe": Preset(4, 256, 688, 8, 4, False, 4096, "float32", 10_000, 3_000,
                             architecture="qwen2-moe", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=128, shared_expert_intermediate_size=256),
    # Mixtral-8x7B: 32 layers, 4096 hidden, 8 experts of 14336 (2 per token), 32 query heads
    # over 8 kv heads, vocab 32000, rope theta 1e6: 46.7B params (12.9B active).
    "mixtral-8x7b": Preset(32, 4096, 14336, 32, 8, False, 32_000, "bfloat16", 40_000, 30_000,
                           max_position_embeddings=32768, model_vocab_size=32_000,
                           rope_theta=1_000_000.0, write_weights=False, architecture="mixtral",
                           num_experts=8, num_experts_per_tok=2),
    # Qwen3-30B-A3B: 48 layers, 2048 hidden, 128 experts of 768 (8 per token), 32 query heads
    # over 4 kv heads of 128, vocab 151936, rope theta 1e6: 30.5B params (3.3B active).
    "qwen3-30b-a3b": Preset(48, 2048, 6144, 32, 4, False, 32_000, "bfloat16", 40_000, 30_000,
                            max_position_embeddings=40960, model_vocab_size=151_936,
                            rope_theta=1_000_000.0, write_weights=False,
                            architecture="qwen3-moe", head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768),
}

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, as in Llama 2
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

# Init scales, chosen so greedy continuations vary (checked by the tests). Projections
# at gain/sqrt(fan_in) keep activations O(1). With tied embeddings the residual stream
# still holds the current token's own embedding, so the model would predict that token
# again forever unless the layers' outputs outweigh it: hence the v/o/mlp gain of 2.
EMBED_STD = 1.0
QK_GAIN = 1.0  # attention sharpness; larger makes logits needlessly sensitive to rounding
PROJ_GAIN = 2.0  # v/o/mlp: layer outputs must outweigh the token's own (tied) embedding
LOGIT_STD = 4.0  # set through the final norm's weight; gives a peaked but not one-hot softmax


def make_model(
    preset: str,
    out: str | Path,
    seed: int = 0,
    max_position_embeddings: int | None = None,
    weights: bool | None = None,
) -> Path:
    """Write the `preset` checkpoint (weights from `seed`) into directory `out`; return `out`.

    `max_position_embeddings` sets the context length (default: the preset's, 2048); the
    weights do not depend on it (rotary embeddings have none), so long prompts can be served
    by the same model. `weights=False` writes config.json and the tokenizer only, for
    `--load-format dummy` (default: the preset's `write_weights`).

    The checkpoint is built in a temporary sibling directory and renamed into place,
    so a concurrent reader never sees half of it. If `out` already holds a
    checkpoint (e.g. another process won the race) it is kept as is.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[preset]
    if max_position_embeddings is not None:
        if max_position_embeddings < 2:
            raise ValueError(
                f"max_position_embeddings must be >= 2, got {max_position_embeddings}")
        p = dataclasses.replace(p, max_position_embeddings=max_position_embeddings)
    out = Path(out)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tokenizer = train_tokenizer(p)
        vocab_size = max(tokenizer.get_vocab_size(), p.model_vocab_size)
        tokenizer.save(str(tmp / "tokenizer.json"))
        config = hf_config(p, vocab_size)
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
        )
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config())
        if p.write_weights if weights is None else weights:
            tensors = random_weights(p, vocab_size, seed)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            os.rename(tmp, out)  # atomic; fails if another writer got there first
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# Bumped whenever what make-model writes changes, so that a cache made by an older version is
# not served as if it were current (2: the chat template renders tools and tool calls).
CHECKPOINT_REVISION = 2


def cached_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """Path of `<cache>/models/<preset>-seed<seed>-r<revision>`, generating it on first use."""
    name = f"{preset}-seed{seed}-r{CHECKPOINT_REVISION}"
    return make_model(preset, cache_dir() / "models" / name, seed)


def default_model_path() -> Path:
    """The `tiny` preset (seed 0), generated into the cache on first use."""
    return cached_model_path("tiny", 0)


def resolve_model_path(model: str | None) -> Path:
    """A model directory, or the built-in `tiny` preset (made once into the cache)."""
    return default_model_path() if model is None else Path(model)


# --------------------------------------------------------------------------- pieces


def train_tokenizer(p: Preset) -> Tokenizer:
    """Byte-level BPE (GPT-2 / Llama 3 style) trained on the generated corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=p.target_vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(p.num_sentences, p.num_made_up_words), trainer)
    # Prepend BOS as Llama 3's tokenizer.json does, so transformers' AutoTokenizer agrees.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
            ),
        ]
    )
    return tokenizer


def _head_dim(p: Preset) -> int:
    return p.head_dim or p.hidden_size // p.num_attention_heads


def hf_config(p: Preset, vocab_size: int) -> dict[str, Any]:
    architecture, model_type = ARCHITECTURES[p.architecture]
    extra: dict[str, Any] = {}
    if p.architecture in ("qwen3", "qwen3-moe", "qwen2-moe"):
        extra["use_sliding_window"] = False
    if p.architecture == "mixtral":
        extra.update(num_local_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                     sliding_window=None, router_aux_loss_coef=0.0)
    if p.architecture in ("qwen3-moe", "qwen2-moe"):
        extra.update(num_experts=p.num_experts, num_experts_per_tok=p.num_experts_per_tok,
                     moe_intermediate_size=p.moe_intermediate_size,
                     norm_topk_prob=p.architecture == "qwen3-moe",
                     decoder_sparse_step=1, mlp_only_layers=list(p.mlp_only_layers),
                     router_aux_loss_coef=0.0)
    if p.architecture == "qwen2-moe":
        extra.update(qkv_bias=True,
                     shared_expert_intermediate_size=p.shared_expert_intermediate_size)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": _head_dim(p),
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": p.tie_word_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": p.dtype,
        "use_cache": True,
        **extra,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": DEFAULT_CHAT_TEMPLATE,
    }


def random_weights(p: Preset, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random tensors in the preset's dtype, drawn in a fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    h, d = p.hidden_size, _head_dim(p)
    q_size, kv_size = p.num_attention_heads * d, p.num_key_value_heads * d

    def normal(std: float, *shape: int) -> torch.Tensor:
        return torch.empty(*shape).normal_(0.0, std, generator=gen)

    weights = {"model.embed_tokens.weight": normal(EMBED_STD, vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        weights[pre + "self_attn.q_proj.weight"] = normal(QK_GAIN / h**0.5, q_size, h)
        weights[pre + "self_attn.k_proj.weight"] = normal(QK_GAIN / h**0.5, kv_size, h)
        weights[pre + "self_attn.v_proj.weight"] = normal(PROJ_GAIN / h**0.5, kv_size, h)
        weights[pre + "self_attn.o_proj.weight"] = normal(PROJ_GAIN / q_size**0.5, h, q_size)
        weights.update(_mlp_weights(p, i, normal))
        weights[pre + "input_layernorm.weight"] = torch.ones(h)
        weights[pre + "post_attention_layernorm.weight"] = torch.ones(h)
        if p.architecture == "qwen2-moe":
            weights[pre + "self_attn.q_proj.bias"] = normal(0.1, q_size)
            weights[pre + "self_attn.k_proj.bias"] = normal(0.1, kv_size)
            weights[pre + "self_attn.v_proj.bias"] = normal(0.1, kv_size)
        if p.architecture in ("qwen3", "qwen3-moe"):  # away from 1: q's and k's told apart
            weights[pre + "self_attn.q_norm.weight"] = 1 + normal(0.2, d)
            weights[pre + "self_attn.k_norm.weight"] = 1 + normal(0.2, d)
    # logits = norm(x) * w . lm_head with norm(x) of unit rms, so their std is
    # w * sqrt(h) * std(lm_head); pick w to hit LOGIT_STD.
    head_std = EMBED_STD if p.tie_word_embeddings else 1.0 / h**0.5
    weights["model.norm.weight"] = torch.full((h,), LOGIT_STD / (h**0.5 * head_std))
    if not p.tie_word_embeddings:
        weights["lm_head.weight"] = normal(head_std, vocab_size, h)
    dtype = getattr(torch, p.dtype)
    return {name: t.to(dtype) for name, t in weights.items()}


def _mlp_weights(p: Preset, layer: int, normal: Callable[..., torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """Layer `layer`'s MLP, or its router and experts, under the hub checkpoints' names."""
    h, pre = p.hidden_size, f"model.layers.{layer}."
    if not p.num_experts or layer in p.mlp_only_layers:
        inter = p.intermediate_size
        return {pre + "mlp.gate_proj.weight": normal(PROJ_GAIN / h**0.5, inter, h),
                pre + "mlp.up_proj.weight": normal(PROJ_GAIN / h**0.5, inter, h),
                pre + "mlp.down_proj.weight": normal(PROJ_GAIN / inter**0.5, h, inter)}
    mixtral = p.architecture == "mixtral"
    inter = p.intermediate_size if mixtral else p.moe_intermediate_size
    block = pre + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    # Router logits of unit spread: each token's choice clear, the choices varied.
    weights = {block + "gate.weight": normal(1 / h**0.5, p.num_experts, h)}
    for e in range(p.num_experts):
        expert = f"{block}experts.{e}."
        weights[f"{expert}{gate}.weight"] = normal(PROJ_GAIN / h**0.5, inter, h)
        weights[f"{expert}{up}.weight"] = normal(PROJ_GAIN / h**0.5, inter, h)
        weights[f"{expert}{down}.weight"] = normal(PROJ_GAIN / inter**0.5, h, inter)
    if p.shared_expert_intermediate_size:
        shared = p.shared_expert_intermediate_size
        weights[block + "shared_expert.gate_proj.weight"] = normal(PROJ_GAIN / h**0.5, shared, h)
        weights[block + "shared_expert.up_proj.weight"] = normal(PROJ_GAIN / h**0.5, shared, h)
        weights[block + "shared_expert.down_proj.weight"] = normal(PROJ_GAIN / shared**0.5,
                                                                   h, shared)
        weights[block + "shared_expert_gate.weight"] = normal(1 / h**0.5, 1, h)
    return weights


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
