"""The draft= group's schemas: one dataclass per conf/draft/<option>.yaml, each naming its drafter class.

`_target_` names the class in specpipe/drafters/<option>.py, which the run builds through its `build` classmethod.
What the checks and the run need to know of a drafter before any torch import is data here (class attributes and
static methods, read through `draft_schema(cfg.draft)`), as are its ranges (`check`): a new drafter is its file,
its dataclass here and its YAML. `method` is a label that metrics.json and messages show; nothing branches on it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING

DRAFT_HEAD = "head"  # drafts_with: the EAGLE head that model= loads with the target (draft.path: its folder)
DRAFT_MODEL = "model"  # drafts_with: a causal LM of its own, loaded from draft.path
MAX_TOPK = 1024  # candidates per expansion; far above any useful tree (EAGLE uses 4-10)
MAX_STEPS = 128  # draft depth: deeper than any chain that gets accepted, small enough to allocate
MAX_TRIE_CELLS = 1 << 22  # n-gram trie: match pairs x depth compared per request and step (~20 bytes each)


@dataclass
class DraftConf:
    _target_: str = MISSING  # the drafter class (a subclass's default; the config group chooses it, never the user)
    method: str = MISSING  # the drafter's label (a subclass's default; leave it alone)
    topk: int = 4  # candidates per expansion (branching factor)
    num_steps: int = 3  # draft depth = draft forwards per round
    num_draft_tokens: int = 8  # tree nodes verified per request, root included
    path: Optional[str] = None  # the draft model's folder: an EAGLE head (None: the model's own) or a causal LM

    speculates: ClassVar[bool] = True  # False: plain decoding, one token per step (draft=none)
    drafts_with: ClassVar[Optional[str]] = None  # DRAFT_HEAD, DRAFT_MODEL, or None (no model: draft.path unread)
    # settings of this schema the drafter never reads, and why: a run notes those set away from their default
    # (draft.path is unread too where drafts_with is None). Their ranges are still checked, as every schema's are
    unread: ClassVar[tuple[str, ...]] = ()
    unread_because: ClassVar[str] = ""

    @staticmethod
    def scratch_columns(num_steps: int) -> int:
        """Draft KV columns per branch and round (`stages.draft_scratch`): none without a draft model."""
        return 0

    @classmethod
    def option(cls) -> str:
        """The conf/draft option (and specpipe/drafters module) of this drafter: the module of the class it names."""
        return cls._target_.rsplit(".", 2)[-2]

    @classmethod
    def label(cls, d) -> str:
        """The drafter as messages and the summary name it (draft=<label>) for the settings `d`."""
        return cls.option()

    @classmethod
    def unread_notes(cls, d) -> list[str]:
        """A note for the settings `d` gives that this drafter never reads (they change nothing, so a run says so,
        rather than ignore them silently): draft.path without a draft model, and the schema's `unread` keys set
        away from its defaults."""
        notes, label, shipped = [], cls.label(d), draft_schemas()
        if cls.drafts_with is None and d.get("path") is not None:
            readers = " and ".join(f"draft={o}" for o, s in shipped.items() if s.drafts_with)
            notes.append(f"specpipe: note: draft.path={d.path} is not read: draft={label} uses no draft model "
                         f"({readers} do)")
        given = [k for k in cls.unread if k != "path" and d.get(k) != getattr(cls, k, None)]
        if given:
            readers = ",".join(o for o, s in shipped.items() if not set(given) & set(s.unread))
            notes.append(f"specpipe: note: {' and '.join(f'draft.{k}={d.get(k)}' for k in given)} "
                         f"{'is' if len(given) == 1 else 'are'} not read: draft={label} {cls.unread_because} "
                         f"(draft={{{readers}}} read {'it' if len(given) == 1 else 'them'})")
        return notes

    @classmethod
    def check(cls, d, errors: list) -> bool:
        """Appends the settings out of range to `errors`; True when the tree's shape settings are in range. A drafter
        with a draft model (`drafts_with`) drafts a top-k tree, whose size those settings bound too (`check_tree`);
        another drafter checks the shape its settings give in its own `check`."""
        ok = True
        for key, most in (("topk", MAX_TOPK), ("num_steps", MAX_STEPS)):
            if not 1 <= d[key] <= most:
                errors.append(f"draft.{key}={d[key]} must be between 1 and {most}")
                ok = False
        if not 2 <= d.num_draft_tokens <= MAX_TOPK:
            errors.append(f"draft.num_draft_tokens={d.num_draft_tokens} must be between 2 (the root plus at least one "
                          f"draft) and {MAX_TOPK}")
            ok = False
        if ok and cls.drafts_with is not None:
            check_tree(d, errors)
        return ok


def check_tree(d, errors: list) -> None:
    """A model drafter's tree: topk candidates per node, num_steps deep, num_draft_tokens of them verified."""
    K, S, N = d.topk, d.num_steps, d.num_draft_tokens
    most = K + (S - 1) * K * K
    if N - 1 > most:
        errors.append(f"draft.num_draft_tokens={N} is too large for topk={K}, num_steps={S}: the tree has at most "
                      f"topk + (num_steps-1)*topk^2 = {most} candidates, so num_draft_tokens must be <= {most + 1}")
    if K == 1 and N > S + 1:
        errors.append(f"draft.num_draft_tokens={N} with topk=1 must be <= num_steps+1 = {S + 1} (a chain of "
                      f"num_steps drafts plus the root)")


@dataclass
class EagleDraftConf(DraftConf):
    _target_: str = "specpipe.drafters.eagle.EagleProposer"
    method: str = "eagle"

    drafts_with: ClassVar[Optional[str]] = DRAFT_HEAD

    @staticmethod
    def scratch_columns(num_steps: int) -> int:
        return num_steps - 1  # step 0 reuses the top-k of the head's extend


def trie_matches(topk: int) -> int:
    """Matches that vote in the n-gram trie: the best alone makes a chain; a trie takes 4 per branch."""
    return 1 if topk == 1 else 4 * topk


def trie_cells(topk: int, num_steps: int) -> int:
    """Cells of the n-gram trie's pairwise prefix table [matches, matches, num_steps], per request."""
    return trie_matches(topk) ** 2 * num_steps


def trie_limit_hint(num_steps: int) -> int:
    """The largest topk whose trie table fits MAX_TRIE_CELLS at this depth (1 always fits)."""
    return max(1, int((MAX_TRIE_CELLS / num_steps) ** 0.5) // 4)


@dataclass
class NgramDraftConf(DraftConf):
    _target_: str = "specpipe.drafters.ngram.NgramProposer"
    method: str = "ngram"
    topk: int = 1  # 1: the best match's continuation (a chain); >1: a trie voted by the 4*topk best matches
    num_steps: int = 4  # draft length
    num_draft_tokens: int = 5
    min_n: int = 1  # shortest n-gram to match
    max_n: int = 3  # longest n-gram to match (tried first)
    cache_tokens: int = 0  # also match in the newest finished requests' outputs, up to this many tokens (0: off)
    cache_prompts: bool = False  # the cache keeps each finished request's prompt too, not only its output
    running_tokens: int = 0  # also match in the other running requests' histories, this many tokens in all (0: off)

    @classmethod
    def label(cls, d) -> str:
        """draft=suffix is the n-gram drafter with a cross-request corpus: named so whichever option set it up."""
        return "suffix" if d.get("cache_tokens", 0) > 0 or d.get("running_tokens", 0) > 0 else "ngram"

    @classmethod
    def check(cls, d, errors: list) -> bool:
        if not 1 <= d.min_n <= d.max_n <= 255:
            errors.append(f"draft.min_n={d.min_n}, draft.max_n={d.max_n}: need 1 <= min_n <= max_n <= 255")
        if d.cache_tokens < 0:
            errors.append(f"draft.cache_tokens={d.cache_tokens} must be >= 0 (0: no cross-request cache; e.g. 8192 "
                          "keeps the newest finished outputs up to that many tokens)")
        if d.running_tokens < 0:
            errors.append(f"draft.running_tokens={d.running_tokens} must be >= 0 (0: requests decoded together do not "
                          "draft from one another; e.g. 4096 shares up to that many of their newest tokens)")
        if not super().check(d, errors):
            return False
        K, S, N = d.topk, d.num_steps, d.num_draft_tokens  # a trie of topk matched continuations, num_steps deep
        if N > 1 + K * S:
            errors.append(f"draft.num_draft_tokens={N} is too large for the n-gram trie of topk={K}, num_steps={S}: "
                          f"it holds at most 1 + topk*num_steps = {1 + K * S} nodes; use draft.num_draft_tokens<="
                          f"{1 + K * S} or a larger topk / num_steps")
        cells = trie_cells(K, S)
        if cells > MAX_TRIE_CELLS:
            M = trie_matches(K)
            errors.append(f"draft.topk={K} with draft.num_steps={S} is too large for the n-gram trie: it compares its "
                          f"{M} (4*topk) best matches pairwise at every depth, {M}*{M}*{S} = {cells:,} cells per "
                          f"request and step ({cells * 20 / 2 ** 30:.1f} GiB of temporaries), above the limit of "
                          f"{MAX_TRIE_CELLS:,}; use draft.topk<={trie_limit_hint(S)} at num_steps={S} (the shipped "
                          "draft=ngram uses topk=4) or fewer draft.num_steps")
        return True


@dataclass
class SuffixDraftConf(NgramDraftConf):
    # the n-gram drafter with the cross-request corpus on (conf/draft/suffix.yaml); labelled ngram as it always was
    _target_: str = "specpipe.drafters.suffix.SuffixProposer"


@dataclass
class StandaloneDraftConf(DraftConf):
    _target_: str = "specpipe.drafters.standalone.StandaloneProposer"
    method: str = "standalone"
    topk: int = 1
    num_steps: int = 4
    num_draft_tokens: int = 5

    drafts_with: ClassVar[Optional[str]] = DRAFT_MODEL

    @staticmethod
    def scratch_columns(num_steps: int) -> int:
        return num_steps  # the root's forward takes a column too


@dataclass
class NoDraftConf(DraftConf):
    _target_: str = "specpipe.drafters.none.NoProposer"
    method: str = "none"
    topk: int = 1
    num_steps: int = 1
    num_draft_tokens: int = 2

    speculates: ClassVar[bool] = False
    unread: ClassVar[tuple[str, ...]] = ("topk", "num_steps", "num_draft_tokens")
    unread_because: ClassVar[str] = "decodes one token per step, with no draft tree"


def draft_schemas() -> dict[str, type]:
    """option -> schema of every drafter specpipe ships: the DraftConf subclasses defined here that name a class,
    found by walking the subclasses (no list to keep in sync); the option is the module of the class it names."""
    found, todo = {}, list(DraftConf.__subclasses__())
    while todo:
        cls = todo.pop(0)
        todo[:0] = cls.__subclasses__()  # depth first: an option's variants follow it
        if cls.__module__ == __name__ and cls._target_ != MISSING:
            found[cls.option()] = cls
    return found


def draft_schema(d) -> Optional[type]:
    """The schema of a draft node: a composed config's `cfg.draft` has its type; a plain dict (metrics.json's config)
    the shipped schema its `_target_` names, or for a dict without one (written before drafters had classes) the
    first whose label field it has. None if none does."""
    from omegaconf import OmegaConf

    kind = OmegaConf.get_type(d) if OmegaConf.is_config(d) else None
    if isinstance(kind, type) and issubclass(kind, DraftConf):
        return kind
    shipped = draft_schemas().values()
    if d.get("_target_") is not None:
        return next((s for s in shipped if s._target_ == d.get("_target_")), None)
    return next((s for s in shipped if s.method == d.get("method")), None)
