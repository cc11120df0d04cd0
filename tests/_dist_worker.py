"""One rank of a distributed test: ``python -m tests._dist_worker SCENARIO RANK WORLD PORT DIR BACKEND``.

Runs a real gloo process group over TCP on localhost. Prints one JSON line with what the
rank saw (``{"ok": ...}`` or ``{"error": type, "message": ...}``) and exits 0, so the
test can check every rank's outcome.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import aiopersist


def model_state(seed: int = 0) -> dict[str, Any]:
    """The same model and optimizer on every rank (as in DDP training)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 7}


def sharded_full(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(13, 24), "b": torch.randn(5), "e": torch.randn(300, 64), "s": torch.randn(2, 3)}


async def scenario(name: str, rank: int, world: int, base: str, backend: str) -> Any:
    paths = [os.path.join(base, "a", "ck"), os.path.join(base, "b", "ck")]
    if name == "replicated":
        state = model_state()
        state["mine"] = torch.full((1000,), float(rank))  # this rank's own
        info = await aiopersist.save(
            state, paths, replicated=lambda n: not n.startswith("mine"), backend=backend
        )
        back = await aiopersist.load(paths[0], backend=backend)  # every rank loads it back: its own "mine"
        assert torch.equal(back["mine"], state["mine"]), "rank-local tensor"
        return {"bytes": info.bytes_written, "files": list(info.files)}
    if name == "reinit":
        # A job that ends its process group and starts a new one (a second phase, a
        # script run twice in one process), here with the ranks numbered the other way
        # round: the checkpoint's gloo group of the first world must not be used for the
        # second (it would gather the ranks' plans in the old order).
        state = model_state()
        await aiopersist.save(state, paths[0] + "-1", replicated=True, backend=backend)
        dist.destroy_process_group()
        rank = world - 1 - rank
        dist.init_process_group(
            "gloo",
            init_method=f"file://{os.path.join(base, 'second-world')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        state["mine"] = torch.full((1000,), float(rank))
        info = await aiopersist.save(
            state, paths[0] + "-2", replicated=lambda n: not n.startswith("mine"), backend=backend
        )
        back = await aiopersist.load(paths[0] + "-2", backend=backend)
        assert torch.equal(back["mine"], state["mine"]), "rank-local tensor"
        return {"bytes": info.bytes_written, "new_rank": rank, "files": list(info.files)}
    if name == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        full = sharded_full()
        state = {
            "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
            "b": distribute_tensor(full["b"], mesh, [Replicate()]),
            "e": distribute_tensor(full["e"], mesh, [Shard(0)]),
            "s": distribute_tensor(full["s"], mesh, [Shard(0)]),
        }
        info = await aiopersist.save(state, paths[0], backend=backend)
        back = await aiopersist.load(paths[0], backend=backend)
        for k, v in full.items():
            assert torch.equal(back[k], v), k
        return {"bytes": info.bytes_written}
    if name == "load-sharded":
        # Loads a checkpoint saved by "sharded" (2 ranks) into DTensors sharded over this
        # world: each rank reads the slices that hold its rows, and checks only those.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        full = sharded_full()
        target = {
            "w": distribute_tensor(torch.zeros(13, 24), mesh, [Shard(0)]),
            # Saved whole (Replicate), loaded sharded: each rank takes its rows of it.
            "b": distribute_tensor(torch.zeros(5), mesh, [Shard(0)]),
            "e": distribute_tensor(torch.zeros(300, 64), mesh, [Shard(0)]),
            # 2 rows over 3 ranks: the last rank holds none.
            "s": distribute_tensor(torch.zeros(2, 3), mesh, [Replicate()] if world < 3 else [Shard(0)]),
        }
        await aiopersist.load(paths[0], into=target, backend=backend)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for k, v in full.items():  # each rank checks its own rows: no collective
            dt = target[k]
            shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
            want = v[offset[0] : offset[0] + shape[0]] if dt.placements[0].is_shard() else v
            assert torch.equal(dt.to_local(), want), k
        return {"rows": list(target["e"].to_local().shape)}
    if name == "ddp":
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 256)))
        info = await aiopersist.save({"model": model, "rank": rank}, paths[0], backend=backend)
        return {"bytes": info.bytes_written}
    if name == "checkpointer":
        state = model_state()
        async with aiopersist.Checkpointer(backend=backend, on_busy="skip") as skipper:
            try:
                await skipper.save(state, paths, replicated=True)
                refused = ""
            except ValueError as exc:  # each rank would decide alone whether to skip
                refused = str(exc)
        async with aiopersist.Checkpointer(backend=backend) as ck:
            handle = await ck.save(state, paths, replicated=True)
            await handle.staged
            with torch.no_grad():  # the next optimizer step, right after the fence
                for p in state["model"].parameters():
                    p.add_(1.0)
            info = await handle.done
        return {"bytes": info.bytes_written, "skip_refused": refused}
    if name == "manager":
        dirs = [os.path.join(base, "a"), os.path.join(base, "b")]
        async with aiopersist.CheckpointManager(dirs, keep_last=1, backend=backend) as mgr:
            for step in (1, 2, 3):
                state = model_state(step)
                handle = await mgr.save(step, state, replicated=True)
                await handle.done
            await mgr.wait()
        dist.barrier()
        mgr = aiopersist.CheckpointManager(dirs, backend=backend)
        back = await mgr.restore()
        await mgr.aclose()
        ref = model_state(3)["model"].state_dict()
        assert all(torch.equal(back["model"][k], v) for k, v in ref.items())
        return {"steps": mgr.steps()}
    if name == "restore-agrees":
        # Each rank reads only its own tensors: rank 1's of step 2 are damaged, so rank 1
        # cannot load step 2 while rank 0 can. Both must restore step 1 (the old code
        # restored step 2 on rank 0 and step 1 on rank 1: a silently mixed job).
        dirs = [os.path.join(base, "a"), os.path.join(base, "b")]
        async with aiopersist.CheckpointManager(dirs, backend=backend) as mgr:
            for step in (1, 2):
                await (await mgr.save(step, {"mine": torch.full((1000,), float(10 * step + rank))})).done
        dist.barrier()
        if rank == 0:
            damaged = [_flip(path, torch.tensor([21.0]).numpy().tobytes()) for path in _files(dirs, "step-2")]
            assert any(damaged), "rank 1's data of step 2 not found"
        dist.barrier()
        mgr = aiopersist.CheckpointManager(dirs, backend=backend)
        back = await mgr.restore()
        await mgr.aclose()
        return {"restored": mgr.restored_step, "value": float(back["mine"][0])}
    if name == "restore-into-mismatch":
        # Rank 1 restores into a state of another shape: not about the checkpoint, so every
        # rank raises (rank 0 RankFailedError), rather than rank 0 restoring alone.
        dirs = [os.path.join(base, "a")]
        async with aiopersist.CheckpointManager(dirs, backend=backend) as mgr:
            await (await mgr.save(1, {"mine": torch.zeros(8)})).done
            dist.barrier()
            target = {"mine": torch.ones(8 if rank == 0 else 9)}
            await mgr.restore(into=target)
        return {"value": float(target["mine"][0])}
    if name == "flatten-fails":
        state: dict[str, Any] = {"w": torch.ones(10)}
        if rank == 1:
            state["bad"] = object()
        await aiopersist.save(state, paths, replicated=True, backend=backend)
        return {}
    if name == "early":
        # Every kind below, one after the other, in one pair of processes.
        kinds = ("metadata", "path", "backend", "snapshot", "closed", "manager")
        return {k: await scenario(f"early-{k}", rank, world, os.path.join(base, k), backend) for k in kinds}
    if name.startswith("early-"):
        # Rank 1 fails before its save's first exchange (an argument, the backend, the
        # snapshot budget, a closed Checkpointer or manager): rank 0, already waiting there,
        # hears of it at once. Then both save again: the ranks are still in step.
        kind = name.removeprefix("early-")
        outcome = {}
        state = {"w": torch.ones(1000)}
        bad = rank == 1
        try:
            if kind == "metadata":
                await aiopersist.save(state, paths, metadata={"k": 1} if bad else None, backend=backend)  # type: ignore[dict-item]
            elif kind == "path":
                await aiopersist.save(state, [] if bad else paths, backend=backend)
            elif kind == "backend":
                await aiopersist.save(state, paths, backend="no-such-backend" if bad else backend)
            elif kind == "snapshot":
                budget = 1024 if bad else None
                async with aiopersist.Checkpointer(
                    backend=backend, mode="snapshot", snapshot_bytes=budget
                ) as ck:
                    await (await ck.save(state, paths)).done
            elif kind == "closed":
                ck = aiopersist.Checkpointer(backend=backend)
                if bad:
                    await ck.aclose()
                try:
                    await (await ck.save(state, paths)).done
                finally:
                    await ck.aclose()
            elif kind == "manager":
                dirs = [os.path.join(base, "a"), os.path.join(base, "b")]
                async with aiopersist.CheckpointManager(dirs, backend=backend) as mgr:
                    meta = {"step": "7"} if bad else None
                    await (await mgr.save(3, state, metadata=meta)).done
            else:
                raise SystemExit(f"unknown scenario {name}")
            outcome["first"] = "ok"
        except Exception as exc:
            outcome["first"] = f"{type(exc).__name__}: {exc}"
        try:
            await aiopersist.save(state, [p + "-again" for p in paths], backend=backend)
            back = await aiopersist.load(paths[0] + "-again", backend=backend)
            outcome["second"] = "ok" if torch.equal(back["w"], state["w"]) else "different"
        except Exception as exc:
            outcome["second"] = f"{type(exc).__name__}: {exc}"
        return outcome
    if name in ("late-rank", "late-rank-one-name", "late-rank-barrier"):
        # Rank 1 comes to save A after rank 0 gave up waiting for it (a timeout breaks the
        # gloo mesh for good: the old code failed every later save on both ranks). The mesh
        # is replaced, rank 1's late A meets rank 0's next exchange and fails (another
        # one), rank 0 gathers again, and from then on the ranks go on together. With one
        # name for every save (overwrite=True), the late A must not pass for rank 0's B:
        # each checkpoint holds one save's values. With a barrier after A (as the Trainer
        # callback's), rank 0's barrier must wait for rank 1's.
        from aiopersist._dist import coordinator

        store = dist.distributed_c10d._get_default_store()
        outcome = {}
        await aiopersist.save({"w": torch.ones(1000)}, paths[0] + "-Z", backend=backend)  # the mesh is made
        if rank == 1:
            await asyncio.to_thread(store.wait, ["rank 0 gave up"])
        for value, save in enumerate(("A", "B", "C"), 1):
            state = {"a": torch.full((1000,), float(value)), "b": torch.full((1000,), float(value))}
            target = paths[0] + ("-X" if name == "late-rank-one-name" else "-" + save)
            try:
                await aiopersist.save(state, target, backend=backend, replicated=True, overwrite=True)
                back = await aiopersist.load(target, backend=backend)
                held = {float(back["a"][0]), float(back["b"][0])}
                outcome[save] = "ok" if held == {float(value)} else f"holds {sorted(held)}"
            except Exception as exc:
                outcome[save] = f"{type(exc).__name__}: {exc}"
            if rank == 0 and save == "A":
                store.set("rank 0 gave up", "")
            if name == "late-rank-barrier" and save == "A":
                coord = coordinator()
                assert coord is not None
                if rank == 1:
                    store.set("rank 1 at the barrier", "")
                try:
                    await asyncio.to_thread(coord.barrier)
                    outcome["barrier"] = "ok"
                except Exception as exc:
                    outcome["barrier"] = f"{type(exc).__name__}: {exc}"
                if rank == 0:
                    outcome["rank 1 at the barrier"] = store.check(["rank 1 at the barrier"])
        return outcome
    if name == "skipped-exchange":
        # Rank 0 makes an exchange that rank 1 never makes (here a barrier alone; in a job,
        # a rank that failed between two exchanges without telling the others): rank 0
        # gives up on it after the timeout. The next save fails on both (the ranks are at
        # different exchanges), and from then on they save together (the old code kept
        # them one exchange apart: every later save failed).
        from aiopersist._dist import coordinator

        store = dist.distributed_c10d._get_default_store()
        outcome = {}
        await aiopersist.save({"w": torch.ones(1000)}, paths[0] + "-Z", backend=backend)  # the mesh is made
        coord = coordinator()
        assert coord is not None
        if rank == 0:
            try:
                await asyncio.to_thread(coord.barrier)
                outcome["barrier"] = "ok"
            except Exception as exc:
                outcome["barrier"] = f"{type(exc).__name__}: {exc}"
            store.set("rank 0 gave up", "")
        else:
            await asyncio.to_thread(store.wait, ["rank 0 gave up"])
        for value, save in enumerate(("A", "B", "C"), 1):
            state = {"a": torch.full((1000,), float(value))}
            try:
                await aiopersist.save(state, paths[0] + "-" + save, backend=backend, replicated=True)
                back = await aiopersist.load(paths[0] + "-" + save, backend=backend)
                outcome[save] = "ok" if float(back["a"][0]) == value else "holds another save's values"
            except Exception as exc:
                outcome[save] = f"{type(exc).__name__}: {exc}"
        try:
            await asyncio.to_thread(coord.barrier)
            outcome["last barrier"] = "ok"
        except Exception as exc:
            outcome["last barrier"] = f"{type(exc).__name__}: {exc}"
        return outcome
    if name in ("killed-while-writing", "restarted"):
        # A complete checkpoint, then rank 1 is killed (SIGKILL) while it writes its share
        # of the next save, which overwrites it: rank 0 must fail at once, naming rank 1
        # as the one that did not come; the complete checkpoint stays. "restarted": the
        # job started again over the same directories loads it and saves again.
        import signal

        import aiopersist._save as save_module

        state = {f"t{i}": torch.full((1000,), 1.0) for i in range(4)}
        if name == "restarted":
            back = await aiopersist.load(paths[0], backend=backend)
            await aiopersist.save(back, paths, replicated=True, backend=backend, overwrite=True)
            return {"loaded": sorted({float(t[0]) for t in back.values()})}
        await aiopersist.save(state, paths, replicated=True, backend=backend)
        if rank == 1:

            async def killed(*args: Any, **kwargs: Any) -> Any:
                os.kill(os.getpid(), signal.SIGKILL)

            save_module._write_mine = killed
        try:
            await aiopersist.save(
                {k: v + 1 for k, v in state.items()}, paths, replicated=True, backend=backend, overwrite=True
            )
        except aiopersist.RankFailedError as exc:
            return {"error": str(exc)}
        return {}
    if name in ("rank0-killed-committing", "rank0-killed-after-commit"):
        # Rank 0 is killed (SIGKILL) while it commits an overwrite: before the rename (two
        # directories), or right after it (one directory). Rank 1 loses contact at the
        # commit's exchange, and its error says what it finds on disk.
        import signal

        import aiopersist._save as save_module

        after = name == "rank0-killed-after-commit"
        where = paths[:1] if after else paths
        await aiopersist.save(
            {"t": torch.ones(1000), "u": torch.ones(1000)}, where, replicated=True, backend=backend
        )
        if rank == 0:
            publish = save_module.publish_with_parts

            def killed(*args: Any) -> None:
                if after:
                    publish(*args)
                os.kill(os.getpid(), signal.SIGKILL)

            save_module.publish_with_parts = killed
        try:
            await aiopersist.save(
                {"t": torch.full((1000,), 2.0), "u": torch.full((1000,), 2.0)},
                where,
                replicated=True,
                backend=backend,
                overwrite=True,
            )
        except aiopersist.RankFailedError as exc:
            return {"error": str(exc), "notes": getattr(exc, "__notes__", [])}
        return {}
    if name in ("store-stopped", "store-stopped-first"):
        # Rank 0 holds the job's store (init_method="tcp://...") and is stopped (SIGSTOP,
        # here sent by rank 1) before its next save: rank 1's save must fail within
        # AIOPERSIST_DIST_TIMEOUT (the store's own calls wait for an answer without a
        # bound: the old code hung there until rank 0 went on). A watchdog continues
        # rank 0 after a while all the same, so that the old code ends too. Then rank 0,
        # late, comes to the save rank 1 gave up, and both save together again.
        import signal
        import threading

        store = dist.distributed_c10d._get_default_store()
        outcome = {}
        if name == "store-stopped":  # else rank 0 is stopped before the mesh is made
            await aiopersist.save({"w": torch.ones(1000)}, paths[0] + "-Z", backend=backend)
        if rank == 0:
            store.set("pid of rank 0", str(os.getpid()))
            await asyncio.to_thread(store.wait, ["rank 0 continued"], datetime.timedelta(seconds=120))
        else:
            pid = int(store.get("pid of rank 0"))
            os.kill(pid, signal.SIGSTOP)
            watchdog = threading.Timer(
                4 * float(os.environ["AIOPERSIST_DIST_TIMEOUT"]), os.kill, (pid, signal.SIGCONT)
            )
            watchdog.start()
        for save in ("A", "B"):
            try:
                await aiopersist.save({"a": torch.ones(1000)}, paths[0] + "-" + save, backend=backend)
                outcome[save] = "ok"
            except Exception as exc:
                outcome[save] = f"{type(exc).__name__}: {exc}"
            if rank == 1 and save == "A":
                # Failed while rank 0 was still stopped (not once the watchdog let it go).
                outcome["rank 0 still stopped"] = not watchdog.finished.is_set()
                watchdog.cancel()
                os.kill(pid, signal.SIGCONT)
                store.set("rank 0 continued", "")
        return outcome
    if name == "subgroups-come-and-go":
        # A subgroup made, saved through and destroyed, again and again: the checkpoint's
        # mesh of each goes with it (the old code kept every one, and its gloo threads,
        # until the world ended), and a group made again under the same name never meets
        # an old mesh's rendezvous.
        import gc

        counts = []
        for i in range(3):
            group = dist.new_group([0, 1], backend="gloo")
            await aiopersist.save({"w": torch.ones(100)}, f"{paths[0]}-{i}", backend=backend, group=group)
            dist.destroy_process_group(group)
            del group
            gc.collect()
            counts.append(len(gloo_threads()))
        return {"gloo threads": counts}
    if name == "while-saving-early":
        # Save 1 is in flight when rank 1 alone refuses save 2's arguments: its failure is
        # told in save 2's turn, after save 1's exchanges, and save 1 commits everywhere
        # (the old code paired it with save 1's first exchange and both saves failed).
        outcome = {}
        async with aiopersist.Checkpointer(backend=backend) as ck:
            first = await ck.save({"w": torch.ones(1 << 20)}, [p + "-1" for p in paths], replicated=True)
            second = [p + "-2" for p in paths]
            try:
                handle = await ck.save({"w": torch.ones(10)}, [second[0]] * 2 if rank == 1 else second)
                await handle.done
                outcome["second"] = "ok"
            except Exception as exc:
                outcome["second"] = f"{type(exc).__name__}: {exc}"
            try:
                await first.done
                outcome["first"] = "ok"
            except Exception as exc:
                outcome["first"] = f"{type(exc).__name__}: {exc}"
        return outcome
    if name == "other-save":
        # Rank 1 is at another save than rank 0 (it failed alone before its exchanges and
        # saved again, under another name): neither takes the other's values.
        await aiopersist.save(
            {"w": torch.ones(10)}, [p + ("-other" if rank else "") for p in paths], backend=backend
        )
        return {}
    if name == "cancel-then-save":
        # Rank 0 gives up on a save waiting for rank 1, then saves again at once: the
        # cancelled exchange must be over before the next one starts on the group.
        outcome: dict[str, str] = {}
        if rank == 0:
            try:
                await asyncio.wait_for(aiopersist.save({"w": torch.ones(10)}, paths, backend=backend), 0.5)
            except BaseException as exc:
                outcome["first"] = type(exc).__name__
            try:
                await aiopersist.save({"w": torch.ones(10)}, [p + "2" for p in paths], backend=backend)
            except BaseException as exc:
                outcome["second"] = type(exc).__name__
        else:
            await asyncio.sleep(3)
            try:
                await aiopersist.save({"w": torch.ones(10)}, paths, backend=backend)
            except BaseException as exc:
                outcome["first"] = type(exc).__name__
        return outcome
    if name == "cancelled-alone":
        # Every kind below, one after the other, in one pair of processes.
        kinds = ("first", "write", "commit", "slot", "restore")
        return {k: await cancelled_alone(k, rank, os.path.join(base, k), backend) for k in kinds}
    if name.startswith("cancelled-alone-"):
        kind = name.removeprefix("cancelled-alone-")
        return {kind: await cancelled_alone(kind, rank, os.path.join(base, kind), backend)}
    if name == "disk-full":
        # Rank 1 writes to the second directory, a 1 MiB tmpfs the test mounted.
        await aiopersist.save({"w": torch.ones(4 << 20)}, paths, replicated=True, backend=backend)
        return {}
    if name == "dies":
        if rank == 1:
            os._exit(3)
        await aiopersist.save({"w": torch.ones(10)}, paths, replicated=True, backend=backend)
        return {}
    if name == "dies-after-commit":
        # Rank 1 dies where rank 0 has published the overwrite and tells the ranks so.
        # Four tensors: each rank writes some, rank 1 into a part on the second disk.
        await aiopersist.save(
            {f"t{i}": torch.ones(1000) for i in range(4)}, paths, replicated=True, backend=backend
        )
        if rank == 1:
            from aiopersist._dist import Coordinator

            real, calls = Coordinator.exchange, [0]

            async def exchange(self: Any, *args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                if calls[0] == 3:  # what each rank wrote, the write's outcome, the commit's
                    os._exit(3)
                return await real(self, *args, **kwargs)

            Coordinator.exchange = exchange  # type: ignore[method-assign]
        try:
            await aiopersist.save(
                {f"t{i}": torch.full((1000,), 2.0) for i in range(4)},
                paths,
                replicated=True,
                backend=backend,
                overwrite=True,
            )
        except aiopersist.RankFailedError as exc:
            return {"error": type(exc).__name__, "notes": getattr(exc, "__notes__", [])}
        return {}
    if name in ("teardown", "teardown-at-exit"):
        # What a job keeps across destroy_process_group(): a Checkpointer, and what the
        # Trainer callback keeps (the process-0 group, the FSDP saver). None of it may keep
        # a gloo group, and its threads, alive past it: a gloo thread still running at
        # interpreter shutdown can abort the process's exit.
        from aiopersist._dist import GroupRef, background_group, coordinator, process0_group
        from aiopersist.integrations._fsdp import ShardedSaver  # imported before the group: see main()

        before = gloo_threads()
        state = model_state()
        await aiopersist.save(state, paths[0], replicated=True, backend=backend)
        ckpt = aiopersist.Checkpointer(backend=backend)
        await (await ckpt.save(state, paths[0] + "-2", replicated=True)).done
        coord = coordinator()
        assert coord is not None
        solo = GroupRef(process0_group(coord))
        saver = ShardedSaver(background_group(coord), backend=backend)
        del coord  # a save's own: kept by nothing once the save is over
        await asyncio.to_thread(saver.save(paths[0] + "-3", {"model": {"w": torch.ones(64)}}).wait)
        during = gloo_threads()
        if name == "teardown-at-exit":  # a program that never calls destroy_process_group()
            _KEPT.extend([ckpt, solo, saver])
            return {"before": before, "during": during}
        dist.destroy_process_group()
        # A group let go of by a worker thread at that moment ends its transport thread a
        # moment later (seen under load): what counts is that none runs on for good.
        for _ in range(100):  # 5 s at most
            after = gloo_threads()
            if not after:
                break
            await asyncio.sleep(0.05)
        try:
            stale = f"{saver.group!r} still usable"
        except RuntimeError as exc:
            stale = str(exc)
        await ckpt.aclose()
        return {"before": before, "during": during, "after": after, "stale": stale}
    if name in ("sharded-disk-full", "sharded-dies"):
        # The FSDP saver of the Trainer callback and Accelerate (every rank writes its
        # shards into one directory) when a save fails: a first checkpoint is saved, then
        # the second fails, on a full disk (the test mounted a small file system at
        # base/small) or with rank 1 dying right after starting it.
        from aiopersist._dist import background_group, coordinator
        from aiopersist.integrations._fsdp import ShardedSaver

        coord = coordinator()
        assert coord is not None
        saver = ShardedSaver(background_group(coord), backend=backend)
        del coord
        where = os.path.join(base, "small") if name == "sharded-disk-full" else base
        first = {"model": {f"w{rank}": torch.full((1024,), float(rank))}}  # each rank its own
        await asyncio.to_thread(saver.save(os.path.join(where, "ck-1"), first).wait)
        size = (4 << 20) if name == "sharded-disk-full" else 1024  # 16 MiB a rank: more than fits
        second = {"model": {f"w{rank}": torch.ones(size)}}
        handle = saver.save(os.path.join(where, "ck-2"), second)
        if name == "sharded-dies" and rank == 1:
            os._exit(3)  # a rank that crashes while its save is in flight
        outcome: dict[str, Any] = {}
        for what, call in (("staged", handle.wait_staged), ("done", handle.wait)):
            try:
                await asyncio.to_thread(call)
                outcome[what] = "ok"
            except Exception as exc:  # BaseException would escape: DCP's own must not
                outcome[what] = f"{type(exc).__name__}: {exc}"
        # What was saved before is untouched: verify raises on anything wrong.
        outcome["first"] = len((await aiopersist.verify(os.path.join(where, "ck-1"), backend=backend)).files)
        return outcome
    raise SystemExit(f"unknown scenario {name}")


def _files(dirs: list[str], step: str) -> list[str]:
    """The files of ``step`` in ``dirs``, parts included."""
    return [os.path.join(r, f) for d in dirs for r, _, files in os.walk(os.path.join(d, step)) for f in files]


def _flip(path: str, pattern: bytes) -> bool:
    """Flip a byte of the first ``pattern`` in the file at ``path``; whether it was there."""
    with open(path, "r+b") as f:
        data = f.read()
        at = data.find(pattern)
        if at < 0:
            return False
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    return True


_KEPT: list[Any] = []
"""What a scenario keeps alive until the process exits."""


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (torch's and gloo's own)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that has just ended
            pass
    return sorted(n for n in names if "gloo" in n)


async def cancelled_alone(kind: str, rank: int, base: str, backend: str) -> dict[str, str]:
    """One rank's save (or restore) is cancelled by its caller where ``kind`` says (before
    the first exchange, while writing, while rank 0 commits, while a Checkpointer's save
    waits for its slot, while a restore loads); the other rank goes on with its own. The
    cancelled rank makes no other exchange until the other one has its outcome (a key in
    the store): the other must hear of the cancellation, not wait for the timeout. Then
    both save again together."""
    import aiopersist._manager as manager_module
    import aiopersist._save as save_module

    paths = [os.path.join(base, "a", "ck"), os.path.join(base, "b", "ck")]
    store = dist.distributed_c10d._get_default_store()
    cancelled = 0 if kind == "commit" else 1
    state = {"w": torch.ones(1 << 16), "v": torch.arange(1000.0)}
    outcome: dict[str, str] = {}
    dirs = [os.path.join(base, "m")]
    if kind == "restore":
        async with aiopersist.CheckpointManager(dirs, backend=backend) as mgr:
            await (await mgr.save(1, state)).done
    reached = asyncio.Event()

    def when_reached(module: Any, attr: str) -> Any:
        """``module.attr`` (a coroutine function), which first says it was reached."""
        real = getattr(module, attr)

        async def reach(*args: Any, **kwargs: Any) -> Any:
            reached.set()
            await asyncio.sleep(0)  # the cancellation lands in the real function
            return await real(*args, **kwargs)

        setattr(module, attr, reach)
        return real

    async def run() -> None:
        if kind == "slot":
            async with aiopersist.Checkpointer(backend=backend) as ck:
                await ck.save(state, [p + "-0" for p in paths])  # in flight (slowed below)
                reached.set()
                await (await ck.save(state, paths)).done
        elif kind == "restore":
            mgr = aiopersist.CheckpointManager(dirs, backend=backend)
            try:
                await mgr.restore()
            finally:
                await mgr.aclose()
        else:
            await aiopersist.save(state, paths, backend=backend)

    real: Any = None
    where = {"first": "flatten_off_loop", "write": "_write_mine", "commit": "_commit"}
    if rank == cancelled and kind in where:
        real = when_reached(save_module, where[kind])
    if rank == cancelled and kind == "restore":
        real = when_reached(manager_module, "load")
    if rank == cancelled and kind == "slot":
        write_mine = save_module._write_mine

        async def slowly(*args: Any, **kwargs: Any) -> Any:  # the first save holds the slot
            await asyncio.sleep(1.5)
            return await write_mine(*args, **kwargs)

        save_module._write_mine = slowly
    try:
        task = asyncio.ensure_future(run())
        if rank == cancelled:
            await reached.wait()
            if kind == "slot":
                await asyncio.sleep(0.3)  # the second save waits for the slot
            task.cancel()
        try:
            await task
            outcome["first"] = "ok"
        except BaseException as exc:
            outcome["first"] = f"{type(exc).__name__}: {exc}"
    finally:
        if rank == cancelled and kind in where:
            setattr(save_module, where[kind], real)
        elif rank == cancelled and kind == "restore":
            manager_module.load = real
        elif rank == cancelled and kind == "slot":
            save_module._write_mine = write_mine
    if rank == cancelled:
        store.wait([f"{base}/told"], datetime.timedelta(seconds=120))
    else:
        store.set(f"{base}/told", "1")
    try:
        if kind == "restore":
            mgr = aiopersist.CheckpointManager(dirs, backend=backend)
            try:
                back = await mgr.restore()
            finally:
                await mgr.aclose()
            assert torch.equal(back["w"], state["w"]), "restored"
        else:
            await aiopersist.save(state, [p + "-again" for p in paths], backend=backend)
        outcome["second"] = "ok"
    except Exception as exc:
        outcome["second"] = f"{type(exc).__name__}: {exc}"
    return outcome


def exit_in_exchange(rank: int, base: str, backend: str) -> None:
    """Rank 0 exits (AIOPERSIST_EXIT_GRACE=0) with a BlockingCheckpointer save waiting at
    an exchange for rank 1, which is alive but does not come: the exit gives up on the
    save, and the gather ends (gloo's timeout) while the interpreter shuts down. That
    must not abort the process ("terminate called without an active exception": the old
    code's gather thread was blocked in torch's C++ frames)."""
    import time

    store = dist.distributed_c10d._get_default_store()
    ck = aiopersist.BlockingCheckpointer(backend=backend)
    ck.save({"w": torch.ones(1000)}, os.path.join(base, "first"), replicated=True).wait()  # the mesh is made
    if rank == 1:
        store.wait(["rank 0 exited"], datetime.timedelta(seconds=60))
        time.sleep(1)  # past rank 0's exit: its gather timed out meanwhile
        ck.close()
        return
    ck.save({"w": torch.ones(1000)}, os.path.join(base, "second"), replicated=True)
    sys.stdout.write(json.dumps({"rank": rank, "exiting": True}) + "\n")
    sys.stdout.flush()

    def told() -> None:  # at exit, after aiopersist's own hooks (registered before it)
        store.set("rank 0 exited", "")

    import atexit

    atexit.register(told)


def main() -> None:
    name, rank, world, port, base, backend = sys.argv[1:7]
    if name.startswith("teardown"):
        # Imported before the process group is made, as a training script imports it.
        # Imported after it, torch.distributed.checkpoint (through torch.distributed.nn,
        # whose functions take the default group as a default argument) holds the default
        # group for good, past destroy_process_group(): torch's doing, not aiopersist's.
        import aiopersist.integrations._fsdp  # noqa: F401
    if rank == "env":  # launched by torchrun: RANK, WORLD_SIZE, MASTER_ADDR, ... are set
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=int(rank),
            world_size=int(world),
            timeout=datetime.timedelta(seconds=60),
        )
    if name == "exit-in-exchange":
        exit_in_exchange(int(rank), base, backend)
        return
    try:
        out = {"ok": asyncio.run(scenario(name, int(rank), int(world), base, backend))}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    # One write per line: under a launcher the ranks share one pipe.
    sys.stdout.write(json.dumps({"rank": int(rank), **out}) + "\n")
    sys.stdout.flush()
    if dist.is_initialized() and name != "teardown-at-exit":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
