"""deepspeed.utils.groups for a zerotrain job: every rank is in one data-parallel group, the whole
job (zerotrain has no tensor, pipeline, sequence or expert parallelism), so the data-parallel
queries answer for the world and the model-parallel ones for a group of one."""
import torch.distributed as dist

from .. import _unsupported


def _world():
    from .. import comm

    comm.init_distributed()
    return dist.group.WORLD


def get_data_parallel_group():
    return _world()


def get_data_parallel_world_size():
    return dist.get_world_size(group=_world())


def get_data_parallel_rank():
    return dist.get_rank(group=_world())


# A model-parallel group of one: this rank alone holds the whole model.
def get_tensor_model_parallel_world_size():
    return 1


def get_tensor_model_parallel_rank():
    return 0


get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank


def get_tensor_model_parallel_src_rank():
    """The global rank of the first rank of this rank's model-parallel group: itself."""
    _world()
    return dist.get_rank()


_NO_MODEL_PARALLELISM = "zerotrain trains data-parallel only"
initialize = _unsupported.function("deepspeed.utils.groups.initialize", _NO_MODEL_PARALLELISM)
get_tensor_model_parallel_group = _unsupported.function("deepspeed.utils.groups.get_tensor_model_parallel_group",
                                                        _NO_MODEL_PARALLELISM)
get_model_parallel_group = _unsupported.function("deepspeed.utils.groups.get_model_parallel_group",
                                                 _NO_MODEL_PARALLELISM)
set_tensor_model_parallel_world_size = _unsupported.function(
    "deepspeed.utils.groups.set_tensor_model_parallel_world_size", _NO_MODEL_PARALLELISM)
_get_sequence_parallel_group = _unsupported.function("deepspeed.utils.groups._get_sequence_parallel_group",
                                                    _NO_MODEL_PARALLELISM)
set_tensor_model_parallel_rank = _unsupported.function("deepspeed.utils.groups.set_tensor_model_parallel_rank",
                                                       _NO_MODEL_PARALLELISM)
