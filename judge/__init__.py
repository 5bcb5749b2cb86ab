"""RULER judging and reward sources.

    from flywheel import judge

    result = await judge.ruler(message_lists, "openai/o3")           # RulerResult: .scores, tokens, cost
    scored = await judge.ruler_score_group(group, "openai/o3", swallow_exceptions=True,
                                           cache=judge.JudgeCache(engine))
    final = judge.combine_rewards(judge_score=0.7, feedback=judge.feedback_reward(label="good"))

Importing this package is cheap: litellm (seconds to import) is loaded on the first judge call.

Exceptions::

    JudgeError
    ├── JudgeCallError              the call failed (after retries, or at once for 4xx)
    │   └── JudgeTimeoutError       no answer within timeout_s
    └── JudgeAnswerError            the judge answered, but not usably
        ├── MalformedAnswerError    not JSON, or not the requested shape
        ├── ScoreCountError         not one entry per trajectory
        ├── TrajectoryIdError       an unknown or repeated trajectory id
        └── ScoreRangeError         a score outside [0, 1]
    InvalidFeedbackError (ValueError)   feedback with no usable reward or label

See ``docs/judge.md``.
"""

from flywheel.judge.cache import JudgeCache
from flywheel.judge.rewards import (
    LABEL_REWARDS,
    FinalReward,
    InvalidFeedbackError,
    RewardPolicy,
    apply_rewards,
    combine_rewards,
    feedback_reward,
)
from flywheel.judge.rubric import DEFAULT_RUBRIC, PROMPT_VERSION, RubricConfig, resolve_rubric, rubric_hash
from flywheel.judge.ruler import (
    Candidate,
    JudgeAnswerError,
    JudgeCallError,
    JudgeConfig,
    JudgeError,
    JudgeTimeoutError,
    MalformedAnswerError,
    RulerResult,
    RulerScore,
    ScoreCountError,
    ScoreRangeError,
    TrajectoryIdError,
    apply_scores,
    build_judge_messages,
    group_cache_key,
    judge_candidates,
    ruler,
    ruler_cache_key,
    ruler_score_group,
)

__all__ = [
    "DEFAULT_RUBRIC",
    "LABEL_REWARDS",
    "PROMPT_VERSION",
    "Candidate",
    "FinalReward",
    "InvalidFeedbackError",
    "JudgeAnswerError",
    "JudgeCache",
    "JudgeCallError",
    "JudgeConfig",
    "JudgeError",
    "JudgeTimeoutError",
    "MalformedAnswerError",
    "RewardPolicy",
    "RubricConfig",
    "RulerResult",
    "RulerScore",
    "ScoreCountError",
    "ScoreRangeError",
    "TrajectoryIdError",
    "apply_rewards",
    "apply_scores",
    "build_judge_messages",
    "combine_rewards",
    "feedback_reward",
    "group_cache_key",
    "judge_candidates",
    "resolve_rubric",
    "rubric_hash",
    "ruler",
    "ruler_cache_key",
    "ruler_score_group",
]
