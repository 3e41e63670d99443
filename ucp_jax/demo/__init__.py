"""A small Flax (nnx) GPT whose parameter layout depends on the parallel layout (demo and tests)."""

from ..models.parallel import Layout as Layout
from ..models.parallel import make_mesh as make_mesh
from ..models.placement import abstract_opt_state as abstract_opt_state
from .experiment import Experiment as Experiment
from .experiment import canonical_state as canonical_state
from .experiment import run_experiment as run_experiment
from .experiment import run_layout as run_layout
from .layouts import from_layout as from_layout
from .layouts import init_canonical as init_canonical
from .layouts import to_layout as to_layout
from .model import GPT as GPT
from .model import GPTConfig as GPTConfig
from .model import abstract_params as abstract_params
from .model import model_from_params as model_from_params
from .model import param_shardings as param_shardings
from .model import ucp_rules as ucp_rules
from .train import batch as batch
from .train import init_opt_state as init_opt_state
from .train import loss_fn as loss_fn
from .train import make_optimizer as make_optimizer
from .train import make_train_step as make_train_step
