//! Under a real Slurm: slurmctld and slurmd started here (Debian's
//! slurm-wlm; no munge: auth/none, on loopback), then `srun -n 4` of a C
//! program that meets through env:// with nothing set by hand, and the
//! same job with one task killed (the survivors shrink and go on), and
//! tasks bound to cores of their own (`--cpu-bind=cores`, task/affinity),
//! which must not take themselves for oversubscribed. Prints a `skipped:`
//! line where Slurm is not installed or cannot start (scripts/setup.sh
//! installs it).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn lib_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_rdistrun"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// slurmctld and slurmd of one test, stopped when dropped.
struct Cluster {
    dir: PathBuf,
    daemons: Vec<Child>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            // SAFETY: signals our own unreaped child.
            unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
        }
        for d in &mut self.daemons {
            let start = Instant::now();
            while d.try_wait().ok().flatten().is_none() && start.elapsed() < Duration::from_secs(5)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = d.kill();
            let _ = d.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Cluster {
    fn conf(&self) -> PathBuf {
        self.dir.join("slurm.conf")
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", self.conf());
        c
    }

    fn log_tail(&self) -> String {
        ["ctld.log", "d.log"]
            .iter()
            .map(|f| {
                let text = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                lines[lines.len().saturating_sub(5)..].join("\n")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Starts a one-node Slurm on loopback, tasks placed by `task` (a
/// TaskPlugin), or says why it cannot.
fn start_slurm(task: &str) -> Result<Cluster, String> {
    for tool in ["slurmctld", "slurmd", "srun", "sinfo"] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        if !found {
            return Err(format!(
                "{tool} is not installed (apt-get install slurm-wlm)"
            ));
        }
    }
    // SAFETY: no arguments.
    if unsafe { libc::geteuid() } != 0 {
        return Err("slurmd runs tasks as their user only when started as root".into());
    }
    let host = Command::new("hostname")
        .arg("-s")
        .output()
        .map_err(|e| e.to_string())?;
    let host = String::from_utf8_lossy(&host.stdout).trim().to_string();
    let dir = std::env::temp_dir().join(format!("rdist-slurm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["state", "spool"] {
        std::fs::create_dir_all(dir.join(sub)).map_err(|e| e.to_string())?;
    }
    let d = dir.display();
    let conf = format!(
        "ClusterName=rdisttest\nSlurmctldHost={host}\nSlurmctldPort={}\nSlurmdPort={}\n\
         AuthType=auth/none\nCredType=cred/none\nProctrackType=proctrack/linuxproc\n\
         TaskPlugin={task}\nSchedulerType=sched/builtin\nSelectType=select/cons_tres\n\
         SelectTypeParameters=CR_CPU\nStateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
         SlurmctldPidFile={d}/ctld.pid\nSlurmdPidFile={d}/d.pid\nSlurmctldLogFile={d}/ctld.log\n\
         SlurmdLogFile={d}/d.log\nSlurmUser=root\nSlurmdUser=root\nReturnToService=2\n\
         MpiDefault=none\nJobAcctGatherType=jobacct_gather/none\n\
         AccountingStorageType=accounting_storage/none\n\
         NodeName={host} CPUs={} State=UNKNOWN\n\
         PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE\n",
        common::free_port(),
        common::free_port(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    std::fs::write(dir.join("slurm.conf"), conf).map_err(|e| e.to_string())?;
    let mut cluster = Cluster {
        dir,
        daemons: Vec::new(),
    };
    for (daemon, args) in [
        ("slurmctld", &["-D", "-c", "-i"][..]),
        ("slurmd", &["-D"][..]),
    ] {
        let child = cluster
            .command(daemon)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("{daemon}: {e}"))?;
        cluster.daemons.push(child);
    }
    let start = Instant::now();
    loop {
        let state = cluster
            .command("sinfo")
            .args(["-h", "-o", "%T"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        if state == "idle" {
            return Ok(cluster);
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "the node is '{state}' after 30 s; the daemons' last words:\n{}",
                cluster.log_tail()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One Slurm at a time: two on one host (each test starts its own) get in
/// each other's way.
static ONE_SLURM: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_slurm() -> std::sync::MutexGuard<'static, ()> {
    ONE_SLURM.lock().unwrap_or_else(|e| e.into_inner())
}

/// `srun -n tasks program args`, bounded.
fn srun(cluster: &Cluster, tasks: usize, program: &Path, args: &[&str]) -> (bool, String) {
    srun_with(cluster, &["--overcommit"], tasks, program, args)
}

/// `srun`, with `options` first.
fn srun_with(
    cluster: &Cluster,
    options: &[&str],
    tasks: usize,
    program: &Path,
    args: &[&str],
) -> (bool, String) {
    let out = common::output_within(
        cluster
            .command("srun")
            .args(options)
            .args(["-n", &tasks.to_string(), "--kill-on-bad-exit=0"])
            .arg(program)
            .args(args)
            .env("LD_LIBRARY_PATH", lib_dir())
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("LOCAL_RANK"),
        Duration::from_secs(90),
        "srun",
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A Slurm of this test's own (tasks placed by `task`) and the rank
/// program compiled beside it; None (and a `skipped:` line) where Slurm
/// cannot start.
fn slurm_with_program(task: &str) -> Option<(Cluster, PathBuf)> {
    let cluster = match start_slurm(task) {
        Ok(c) => c,
        Err(why) => {
            println!("skipped: no Slurm with {task}: {why}");
            return None;
        }
    };
    let exe = cluster.dir.join("slurm_ranks");
    common::compile_c("tests/c/slurm_ranks.c", &exe, &lib_dir());
    Some((cluster, exe))
}

#[test]
fn srun_starts_a_c_program_that_meets_with_nothing_set_by_hand() {
    let _one = one_slurm();
    let Some((cluster, exe)) = slurm_with_program("task/none") else {
        return;
    };
    let (ok, text) = srun(&cluster, 4, &exe, &["run"]);
    assert!(ok, "{text}");
    for r in 0..4 {
        assert!(
            text.contains(&format!("rank {r} of 4: ok")),
            "rank {r}:\n{text}"
        );
    }
    // A task killed: the others' next call fails naming it, at once.
    let started = Instant::now();
    let (ok, text) = srun(&cluster, 4, &exe, &["kill"]);
    assert!(!ok, "a killed task went unreported:\n{text}");
    for r in [0, 2, 3] {
        assert!(
            text.contains(&format!(
                "rank {r}: after the kill: peer lost; failed ranks: 1 ("
            )),
            "rank {r}:\n{text}"
        );
        // ... and the survivors shrank and went on: 0, 2, 3 -> 0, 1, 2.
        let new_rank = [0, 0, 1, 2][r];
        assert!(
            text.contains(&format!("rank {r}: shrunk: rank {new_rank} of 3, sum 8")),
            "rank {r}:\n{text}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn tasks_bound_to_cores_of_their_own_are_not_oversubscribed() {
    // srun --cpu-bind=cores gives each task one core: the tasks have the
    // host's cores together, and spin as tasks that are not bound do.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        println!("skipped: binding tasks to cores of their own needs 2 CPUs");
        return;
    }
    let _one = one_slurm();
    let Some((cluster, exe)) = slurm_with_program("task/affinity") else {
        return;
    };
    let bound = ["--cpu-bind=verbose,cores", "--export=ALL,RDIST_DEBUG=INFO"];
    let (ok, text) = srun_with(&cluster, &bound, 2, &exe, &["run"]);
    assert!(ok, "{text}");
    assert!(text.contains("cpu-bind"), "srun did not bind: {text}");
    let tuning: Vec<&str> = text.lines().filter(|l| l.contains("tuning: ")).collect();
    assert_eq!(tuning.len(), 2, "{text}");
    // Two cores, or more where a core is several hardware threads.
    for line in tuning {
        assert!(line.contains("2 ranks here on "), "{line}\n{text}");
        assert!(!line.contains("2 ranks here on 1 cores"), "{line}");
        assert!(!line.contains("oversubscribed"), "{line}");
    }
}
