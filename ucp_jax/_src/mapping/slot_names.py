"""The names of slots, the arrays stored per atom: the value, optimizer moments, the step.

>>> SLOT_ALIASES["mu"]
'exp_avg'
"""

# optax field name -> slot name (DeepSpeed's names, so a DeepSpeed universal folder maps 1:1).
SLOT_ALIASES = {"mu": "exp_avg", "nu": "exp_avg_sq"}
PARAM_SLOT = "fp32"
STEP_SLOT = "step"  # per-atom optimizer step (DeepSpeed); an optax count on restore
VALUE_SLOT = "value"
