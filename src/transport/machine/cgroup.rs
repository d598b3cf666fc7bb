//! What the process's control group allows it: the machine's CPUs its
//! threads may be placed on (the cpuset), and how many cores' time it may
//! use (the CPU quota), cgroup v2 or v1, read from /proc/self/cgroup's
//! paths.

use super::cpu_list;

/// The CPUs of the machine that this process's threads may be placed on:
/// its cgroup's cpuset (a container's share), else every online CPU,
/// without those the kernel keeps for itself (`isolcpus`); empty where
/// none can be read. A process bound to fewer (taskset, a launcher's
/// binding) may still place a thread of its own on them.
pub(crate) fn machine_cpus() -> Vec<usize> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let cgroups = read("/proc/self/cgroup").unwrap_or_default();
    let listed = cgroup_file(
        &cgroups,
        "cpuset.cpus.effective",
        "cpuset",
        "cpuset.effective_cpus",
        read,
    )
    .map(|list| cpu_list(list.trim()))
    .filter(|cpus| !cpus.is_empty())
    .or_else(|| read("/sys/devices/system/cpu/online").map(|list| cpu_list(list.trim())))
    .unwrap_or_default();
    let isolated = read("/sys/devices/system/cpu/isolated")
        .map(|list| cpu_list(list.trim()))
        .unwrap_or_default();
    let kept: Vec<usize> = listed
        .iter()
        .copied()
        .filter(|c| !isolated.contains(c))
        .collect();
    if kept.is_empty() {
        listed
    } else {
        kept
    }
}

/// The cores' time the cgroup's CPU quota allows (rounded up), if it sets
/// one: v2's `cpu.max`, v1's `cpu.cfs_quota_us` over `cpu.cfs_period_us`.
pub(crate) fn quota_cores() -> Option<u32> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    quota_of(&read("/proc/self/cgroup")?, read)
}

fn quota_of(cgroups: &str, read: impl Fn(&str) -> Option<String>) -> Option<u32> {
    let (quota, period) = match cgroup_file(cgroups, "cpu.max", "cpu", "cpu.cfs_quota_us", &read) {
        Some(max) if max.contains(' ') || max.trim() == "max" => {
            // v2: "QUOTA PERIOD", or "max PERIOD".
            let mut parts = max.split_whitespace();
            (
                parts.next()?.parse::<i64>().ok()?,
                parts.next()?.parse::<i64>().ok()?,
            )
        }
        Some(quota) => {
            let period = cgroup_file(cgroups, "", "cpu", "cpu.cfs_period_us", &read)?;
            (
                quota.trim().parse::<i64>().ok()?,
                period.trim().parse::<i64>().ok()?,
            )
        }
        None => return None,
    };
    if quota <= 0 || period <= 0 {
        return None;
    }
    let cores = (quota + period - 1) / period;
    Some(cores.clamp(1, i64::from(u32::MAX)) as u32)
}

/// A file of the process's cgroup (`cgroups`: /proc/self/cgroup's text),
/// read with `read`: v2's `v2_name` in the unified hierarchy, else v1's
/// `v1_name` in the hierarchy that has controller `v1_controller`.
fn cgroup_file(
    cgroups: &str,
    v2_name: &str,
    v1_controller: &str,
    v1_name: &str,
    read: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    let v2 = (!v2_name.is_empty())
        .then(|| cgroups.lines().find_map(|l| l.strip_prefix("0::")))
        .flatten()
        .and_then(|path| {
            read(&format!(
                "/sys/fs/cgroup{}/{v2_name}",
                path.trim_end_matches('/')
            ))
        });
    v2.or_else(|| {
        cgroups.lines().find_map(|l| {
            let mut fields = l.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            if !controllers.split(',').any(|c| c == v1_controller) {
                return None;
            }
            let path = path.trim_end_matches('/');
            read(&format!("/sys/fs/cgroup/{controllers}{path}/{v1_name}"))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(found: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |path: &str| {
            found
                .iter()
                .find(|(p, _)| *p == path)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_cpuset_is_v2s_else_v1s() {
        let v2 = "0::/user.slice/job\n";
        let read = files(&[(
            "/sys/fs/cgroup/user.slice/job/cpuset.cpus.effective",
            "0-3\n",
        )]);
        let got = cgroup_file(
            v2,
            "cpuset.cpus.effective",
            "cpuset",
            "cpuset.effective_cpus",
            read,
        );
        assert_eq!(got.as_deref(), Some("0-3\n"));
        let v1 = "4:memory:/x\n3:cpuset:/docker/abc\n0::/\n";
        let read = files(&[(
            "/sys/fs/cgroup/cpuset/docker/abc/cpuset.effective_cpus",
            "2,5",
        )]);
        let got = cgroup_file(
            v1,
            "cpuset.cpus.effective",
            "cpuset",
            "cpuset.effective_cpus",
            read,
        );
        assert_eq!(got.as_deref(), Some("2,5"));
        let nothing = cgroup_file(v1, "cpuset.cpus.effective", "cpuset", "x", |_| None);
        assert_eq!(nothing, None);
        assert!(!machine_cpus().is_empty());
    }

    #[test]
    fn a_quota_is_its_cores_rounded_up() {
        let v2 = "0::/job\n";
        let read = files(&[("/sys/fs/cgroup/job/cpu.max", "250000 100000\n")]);
        assert_eq!(quota_of(v2, read), Some(3));
        let read = files(&[("/sys/fs/cgroup/job/cpu.max", "max 100000\n")]);
        assert_eq!(quota_of(v2, read), None);
        let v1 = "5:cpu,cpuacct:/docker/abc\n";
        let read = files(&[
            (
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us",
                "400000\n",
            ),
            (
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us",
                "100000\n",
            ),
        ]);
        assert_eq!(quota_of(v1, read), Some(4));
        let read = files(&[
            (
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us",
                "-1\n",
            ),
            (
                "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us",
                "100000\n",
            ),
        ]);
        assert_eq!(quota_of(v1, read), None);
        assert_eq!(quota_of(v1, |_| None), None);
    }
}
