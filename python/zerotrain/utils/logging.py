"""deepspeed.utils.logger and log_dist: DeepSpeed's logger (named "DeepSpeed", so that a script
that configures it by name reaches this one), which prints to stdout at WARNING and above unless
its level is changed, and the rank-filtered log_dist."""
import functools
import logging
import sys

import torch.distributed as dist

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}


def _create_logger(name, level):
    made = logging.getLogger(name)
    made.setLevel(level)
    made.propagate = False
    if not made.handlers:  # one handler, however often the module is loaded
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        made.addHandler(handler)
    return made


logger = _create_logger("DeepSpeed", logging.WARNING)


@functools.lru_cache(None)
def warning_once(*args, **kwargs):
    """logger.warning, once per distinct message."""
    logger.warning(*args, **kwargs)


logger.warning_once = warning_once


def _dist_message(message, ranks):
    """DeepSpeed's rule: every rank logs before the job is joined; after, the ranks listed (-1 first:
    all of them). The message gets a "[Rank r] " prefix, r being -1 before the job is joined."""
    joined = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if joined else -1
    ranks = ranks or []
    if not joined or (ranks and (ranks[0] == -1 or rank in set(ranks))):
        return f"[Rank {rank}] {message}"
    return None


def log_dist(message, ranks=None, level=logging.INFO):
    text = _dist_message(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message, ranks=None):
    """log_dist's rule, printed whatever the logger's level."""
    text = _dist_message(message, ranks)
    if text is not None:
        print(text)


@functools.lru_cache(None)
def _log_dist_once(message, ranks, level):
    log_dist(message, ranks=None if ranks is None else list(ranks), level=level)


def log_dist_once(message, ranks=None, level=logging.INFO):
    _log_dist_once(message, None if ranks is None else tuple(ranks), level)


logger.log_dist_once = log_dist_once


def get_log_level_from_string(log_level_str):
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str!r} is not a logging level; expected one of {', '.join(log_levels)}")
    return level


def set_log_level_from_string(log_level_str, custom_logger=None):
    (custom_logger or logger).setLevel(get_log_level_from_string(log_level_str))
