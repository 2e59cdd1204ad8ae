"""One rollout's turns.

The text and vision episodes, their engine and env calls, the engine reply contract, chat
templating and its fast render path.
"""
