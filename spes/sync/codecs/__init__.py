"""Codecs: how a round's tensors travel (`spes.sync.codecs.registry` names them; `base` is what every one is)."""
