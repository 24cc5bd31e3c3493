"""The episode plane: what rollout workers talk to, through the swarm server.

    app.py            the private app on the engine's socket (status, episodes, `/v1/*`)
    episode_plane.py  `EpisodePlane`: the state every route of the app serves from
    episodes.py       the episode registry: claims, idle timeouts, per-task groups
    serving.py        one completion of an episode, shared by every `/v1/*` route
    openai_api.py     chat completions, completions, models
    responses_api.py  the Responses API
    messages_api.py   Anthropic's Messages API (and count_tokens)
    request_policy.py which request fields the engine honours, accepts or refuses, and
                      `PlaneRequest`, the one request every API's body becomes
    chat_format.py    chat template rendering and tool-call parsing
"""
