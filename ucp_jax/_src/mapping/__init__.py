"""Leaves <-> atoms: how a train state maps to the universal tensors, and back.

`names` names leaves (key paths joined with '.'); `patterns` are the index maps between a leaf's
layout and its atoms (a new pattern goes there, registered in `pattern_json`, which reads and
writes patterns as the manifest records them); `rules` pick a pattern chain per
leaf; `slots` sorts an optax state into per-atom slots; `binding` binds a whole
(params, opt_state) tree to atoms and decides which process writes or reads which region.
"""
