"""What a forward may change in a model besides its tensors, and how a rerun puts it back: the modules' plain
attributes (`attributes.py`: a call counter, a list the forward appends to) and the random generators the modules
hold of their own (`generators.py`). Sentinel mode's replay and a cause's rerun both leave the model as they found it.
"""

__all__: list[str] = []
