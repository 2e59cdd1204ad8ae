"""How rollouts live and die.

The supervisor of one ``generate()`` call, the batch's and each attempt's contexts, pausable
deadlines, the straggler cutoff, the cleanup engine, the gc policy, the loop-lag sampler and the
user's own frame of an error.
"""
