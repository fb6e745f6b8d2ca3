"""The server freezes its start-up heap out of the garbage collector's walks while it serves
(engine/gc_heap.py) and unfreezes it at shutdown."""

import gc

from platform_testlib import make_settings, run_server


def test_the_server_freezes_its_heap_while_serving_and_unfreezes_at_shutdown(tmp_path, tiny_engine):
    from loraplex.platform.main import create_app

    gc.unfreeze()
    settings = make_settings(tmp_path, served_model_name="tiny", gc_freeze=True)
    assert type(settings).model_fields["gc_freeze"].default is True  # the server's default
    app = create_app(settings, tiny_engine)
    live = run_server(app)
    try:
        assert gc.get_freeze_count() > 0
        assert not any(o is app for o in gc.get_objects())  # built before start-up: frozen
        with live.admin() as admin:
            assert admin.get("/admin/tenants").status_code == 200
    finally:
        live.stop()
    assert gc.get_freeze_count() == 0


def test_gc_freeze_off_leaves_the_collector_alone(tmp_path, tiny_engine):
    from loraplex.platform.main import create_app

    gc.unfreeze()
    live = run_server(create_app(make_settings(tmp_path, served_model_name="tiny", gc_freeze=False), tiny_engine))
    try:
        assert gc.get_freeze_count() == 0
    finally:
        live.stop()
