"""The adversarial suite: every way an attacker or a careless operator was seen to break the agent.

Each test reproduces one case of the hardening issue (a malformed object, an injection string, a
hostile file, a fault behind the agent's back, a flood) and checks that the agent keeps serving
the valid services, in both modes where the case exists in both.
"""
