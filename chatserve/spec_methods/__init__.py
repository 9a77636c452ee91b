"""The registry of speculation methods: name -> class. Config, CLI, protocol, server and UI
read the method list from here, so a new method is one class and one line below."""

from chatserve.spec_methods.base import Offer, SpecMethod, SpecState
from chatserve.spec_methods.draft_model import DraftModelMethod
from chatserve.spec_methods.eagle import EagleMethod
from chatserve.spec_methods.ngram import NgramMethod
from chatserve.spec_methods.suffix import SuffixMethod

SPEC_METHODS: dict[str, type[SpecMethod]] = {
    DraftModelMethod.name: DraftModelMethod,
    NgramMethod.name: NgramMethod,
    SuffixMethod.name: SuffixMethod,
    EagleMethod.name: EagleMethod,
}

__all__ = ["SPEC_METHODS", "Offer", "SpecMethod", "SpecState"]
