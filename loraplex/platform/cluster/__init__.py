"""Engine replicas on Ray Serve behind the platform's gateway (``loraplex serve --replicas N``).

- :mod:`.routing`: adapter-aware replica ranking, plain Python (no Ray).
- :mod:`.stats`: merges the replicas' stats snapshots, plain Python (no Ray).
- :mod:`.router`: the Ray Serve ``RequestRouter`` that applies it.
- :mod:`.replica`: the deployment body, one ``AsyncEngine`` per replica.
- :mod:`.client`: :class:`~.client.ReplicaEngineClient`, the gateway's engine client.
- :mod:`.launch`: starts (or joins) Ray, deploys the replicas, returns the client.

Every module but :mod:`.routing` and :mod:`.stats` imports Ray (the ``cluster`` extra); nothing outside this
package imports them at module level, so single-process serving never needs Ray.
"""
