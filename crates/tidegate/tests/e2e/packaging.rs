//! The Debian package (scripts/package, packaging/debian/): built from the
//! binary these tests use, installed with `dpkg -i` (twice: a reinstall
//! over itself), run as the packaged user, purged, and nothing left behind.
//! It needs root and dpkg; without them it fails and says so (CI runs as
//! root). Only this test touches dpkg; a lock file keeps two runs of the
//! suite from installing at the same time.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::*;

const PACKAGE: &str = "tidegate";
const USER: &str = "tidegate";
const DATA: &str = "/var/lib/tidegate";
const CONF: &str = "/etc/tidegate";
/// dpkg wants ldconfig and start-stop-daemon on the PATH, and the
/// maintainer scripts adduser: a PATH with the sbin directories.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// What the package enables (postinst) and purge must remove again.
const ENABLED: [&str; 2] = [
    "/etc/systemd/system/multi-user.target.wants/tidegate.service",
    "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/tidegate.service",
];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .env("PATH", PATH)
        .output()
        .unwrap_or_else(|e| panic!("{program} could not be run: {e}"))
}

fn run_ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {}: {}\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `getent DATABASE NAME`'s fields, when there is an entry.
fn getent(database: &str, name: &str) -> Option<Vec<String>> {
    let out = run("getent", &[database, name]);
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().split(':').map(str::to_string).collect())
}

/// dpkg's status of the package (`install ok installed`, ...), when dpkg
/// knows it.
fn package_status() -> Option<String> {
    let out = run("dpkg-query", &["-W", "-f=${Status}", PACKAGE]);
    let status = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !status.is_empty() && status != "unknown ok not-installed").then_some(status)
}

/// Holds an exclusive lock for the test's dpkg work across test processes.
fn lock_dpkg_work() -> nix::fcntl::Flock<std::fs::File> {
    let dir = if Path::new("/run/lock").is_dir() { "/run/lock" } else { "/tmp" };
    let path = format!("{dir}/tidegate-e2e-packaging.lock");
    let mut file = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return lock,
            Err((back, errno)) => {
                assert!(
                    errno == nix::errno::Errno::EWOULDBLOCK && Instant::now() < deadline,
                    "{path}: another run of the packaging test has held it for 2 minutes ({errno})"
                );
                file = back;
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// The users and groups, and the enablement links under /etc/systemd and
/// deb-systemd-helper's state: what purge must give back as it was.
fn system_state() -> String {
    let mut state = String::new();
    for file in ["/etc/passwd", "/etc/group"] {
        state += &std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{file}: {e}"));
    }
    for dir in ["/etc/systemd", "/var/lib/systemd/deb-systemd-helper-enabled"] {
        state += &String::from_utf8_lossy(&run("find", &[dir]).stdout);
    }
    state
}

/// On failure after the install, stops what the test started and purges
/// the package, so that the next run finds the machine as it was.
struct Installed {
    server: Option<Child>,
    purged: bool,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(mut child) = self.server.take() {
            if let Some(pid) = server_pid(&child) {
                let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if !self.purged {
            let _ = run("dpkg", &["--purge", PACKAGE]);
        }
    }
}

/// The tidegate process `runuser` started (its only child).
fn server_pid(runuser: &Child) -> Option<u32> {
    let pid = runuser.id();
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?.split_whitespace().next()?.parse().ok()
}

/// The first line of `child`'s stdout, within `limit`; the rest is drained.
fn first_line(child: &mut Child, limit: Duration) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        let _ = tx.send(line);
        for _ in reader.lines() {}
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("no ready line within {limit:?}")).trim().to_string()
}

/// Fails unless this runs as root with dpkg.
fn check_root_and_dpkg() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the packaging test installs a Debian package with dpkg: it must run as root (CI does; \
         run it with sudo or as root)"
    );
    for tool in ["dpkg", "dpkg-deb", "dpkg-query"] {
        assert!(
            Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success()),
            "the packaging test needs {tool} (a Debian system; scripts/test installs what is missing)"
        );
    }
}

/// Fails unless the machine has no `tidegate` package, user, group or
/// directory: the test's purge would remove an operator's.
fn check_nothing_installed() {
    if let Some(status) = package_status() {
        panic!("the package {PACKAGE} is already on this machine ({status}); the test would remove it: not run");
    }
    for leftover in [DATA, CONF] {
        assert!(!Path::new(leftover).exists(), "{leftover} exists: the test's purge would remove it; not run");
    }
    assert!(getent("passwd", USER).is_none(), "a user {USER} exists: the test's purge would remove it; not run");
    assert!(getent("group", USER).is_none(), "a group {USER} exists: the test's purge would remove it; not run");
}

/// `scripts/package --fast` of the binary the tests use, into `out`; the
/// package's path.
fn build_package(out: &Path) -> String {
    let built = Command::new(workspace().join("scripts/package"))
        .args(["--binary", env!("CARGO_BIN_EXE_tidegate"), "--fast", "--out"])
        .arg(out)
        .env("PATH", format!("{PATH}:{}", std::env::var("PATH").unwrap_or_default()))
        .output()
        .expect("run scripts/package");
    assert!(built.status.success(), "scripts/package: {}", String::from_utf8_lossy(&built.stderr));
    let deb = String::from_utf8_lossy(&built.stdout).lines().last().unwrap_or_default().to_string();
    assert!(deb.ends_with(".deb") && Path::new(&deb).is_file(), "no package: {deb:?}");
    deb
}

/// What postinst and the package put in place; the user's uid and gid.
fn check_installed() -> (u32, u32) {
    assert_eq!(package_status().as_deref(), Some("install ok installed"));
    assert_eq!(run_ok("dpkg", &["--verify", PACKAGE]), "", "the installed files match the md5sums");
    let user = getent("passwd", USER).expect("postinst created the user");
    let group = getent("group", USER).expect("postinst created the group");
    let (uid, gid): (u32, u32) = (user[2].parse().expect("a uid"), group[2].parse().expect("a gid"));
    assert!(uid < 1000, "a system user: {user:?}");
    assert_eq!(user[3], group[2], "the user's group is {USER}");
    assert_eq!(user[5], DATA, "home");
    assert_eq!(user[6], "/usr/sbin/nologin", "no login shell");
    let data = std::fs::metadata(DATA).expect("the data directory");
    assert_eq!((data.uid(), data.gid(), data.mode() & 0o7777), (uid, gid, 0o700), "{DATA}");
    let conf = std::fs::metadata(CONF).expect("the configuration directory");
    assert_eq!((conf.uid(), conf.gid(), conf.mode() & 0o7777), (0, gid, 0o750), "{CONF}");
    let binary = std::fs::metadata("/usr/bin/tidegate").expect("the binary");
    assert_eq!(binary.mode() & 0o7777, 0o755);
    for file in [
        "/usr/share/man/man1/tidegate.1.gz",
        "/usr/share/man/man1/tidegate-serve.1.gz",
        "/lib/systemd/system/tidegate.service",
        "/usr/share/doc/tidegate/copyright",
        ENABLED[0],
    ] {
        assert!(Path::new(file).exists(), "{file} is installed");
    }
    let conffiles = run_ok("dpkg-query", &["-W", "-f=${Conffiles}", PACKAGE]);
    assert!(conffiles.contains("/etc/tidegate/tidegate.yaml"), "{conffiles}");
    run_ok("/usr/bin/tidegate", &["validate", "/etc/tidegate/tidegate.yaml"]);
    (uid, gid)
}

/// Starts the service's command as the packaged user, on free loopback
/// ports and with the packaged configuration file (which the user must be
/// able to read); its admin address and the tidegate process's id.
fn start_as_the_user(installed: &mut Installed) -> (String, u32) {
    let mut server = Command::new("runuser")
        .args(["-u", USER, "--", "/usr/bin/tidegate", "serve", "--data-dir", DATA])
        .args(["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--workers", "2"])
        .args(["--config", "/etc/tidegate/tidegate.yaml"])
        .env("PATH", PATH)
        .env("TIDEGATE_LOG", "warn")
        .env_remove("TIDEGATE_ADMIN_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run runuser");
    let line = first_line(&mut server, Duration::from_secs(20));
    installed.server = Some(server);
    let admin = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("admin="))
        .unwrap_or_else(|| panic!("no admin address in {line:?}"))
        .to_string();
    let pid = server_pid(installed.server.as_ref().expect("started")).expect("runuser's child, tidegate");
    (admin, pid)
}

/// The process runs as the user, answers with the token it generated, and
/// has the packaged configuration.
async fn check_running(admin: &str, pid: u32, uid: u32, gid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process status");
    let ids = |key: &str| -> Vec<u32> {
        let line = status.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("{key} in {status}"));
        line.split_whitespace().skip(1).map(|n| n.parse().expect("an id")).collect()
    };
    assert_eq!(ids("Uid:"), vec![uid; 4], "tidegate runs as {USER}");
    assert_eq!(ids("Gid:"), vec![gid; 4], "tidegate runs in the group {USER}");

    let token = std::fs::read_to_string(format!("{DATA}/admin-token")).expect("the generated admin token");
    let token_file = std::fs::metadata(format!("{DATA}/admin-token")).expect("the token file");
    assert_eq!((token_file.uid(), token_file.mode() & 0o777), (uid, 0o600), "the token is the user's alone");
    let r = send("GET", &format!("http://{admin}/v1/status"), Some(token.trim()), Vec::new(), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let doc: Value = serde_json::from_slice(&r.body).expect("JSON");
    assert_eq!(doc["store"]["location"], "/var/lib/tidegate/config.sqlite", "{doc}");
    assert!(doc["services"]["web"].is_object(), "the packaged configuration is loaded: {doc}");
    let r = send("GET", &format!("http://{admin}/v1/status"), None, Vec::new(), &[]).await;
    assert_eq!(r.status, 401, "the admin API wants the token");
}

/// SIGTERM to the tidegate process; it drains and exits, and runuser with it.
fn stop(installed: &mut Installed, pid: u32) {
    let status = Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("run kill");
    assert!(status.success(), "kill -TERM {pid}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(exit) = installed.server.as_mut().expect("started").try_wait().expect("try_wait") {
            installed.server = None;
            break exit;
        }
        assert!(Instant::now() < deadline, "tidegate did not exit within 20 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(exit.success(), "tidegate drained and exited: {exit}");
}

/// Nothing of the package is left, and the machine is as `before`.
fn check_purged(before: &str) {
    assert_eq!(package_status(), None, "purged");
    for gone in ["/usr/bin/tidegate", "/usr/share/man/man1/tidegate-serve.1.gz", DATA, CONF, ENABLED[0], ENABLED[1]] {
        assert!(!Path::new(gone).exists(), "{gone} is left after the purge");
    }
    assert!(getent("passwd", USER).is_none(), "the user is removed");
    assert!(getent("group", USER).is_none(), "the group is removed");
    assert_eq!(system_state(), before, "users, groups and systemd links are as before the install");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_package_installs_runs_as_its_user_and_purges() {
    check_root_and_dpkg();
    let _lock = lock_dpkg_work();
    check_nothing_installed();
    let before = system_state();
    let started = Instant::now();
    let out = tempfile::tempdir().unwrap();
    let deb = build_package(out.path());

    let mut installed = Installed { server: None, purged: false };
    run_ok("dpkg", &["-i", &deb]);
    // Again, over itself: the maintainer scripts are idempotent.
    run_ok("dpkg", &["-i", &deb]);
    if Path::new("/run/systemd/system").is_dir() {
        // postinst started the service; the test runs its own instance.
        let _ = run("systemctl", &["stop", "tidegate.service"]);
    }
    let (uid, gid) = check_installed();

    let (admin, pid) = start_as_the_user(&mut installed);
    check_running(&admin, pid, uid, gid).await;
    stop(&mut installed, pid);

    run_ok("dpkg", &["--purge", PACKAGE]);
    installed.purged = true;
    check_purged(&before);
    eprintln!("packaging: built, installed twice, ran and purged in {:?}", started.elapsed());
}

/// The packaged units stay valid (`systemd-analyze verify`, against the
/// built binary; man pages are not installed here, hence `--man=no`).
#[test]
fn the_packaged_units_verify() {
    let Ok(which) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("systemd-analyze is not installed: skipped");
        return;
    };
    assert!(which.status.success());
    let dir = tempfile::tempdir().unwrap();
    let units = ["tidegate.service", "tidegate.socket", "tidegate-admin.socket"];
    for unit in units {
        let text = std::fs::read_to_string(workspace().join("packaging/debian").join(unit)).unwrap();
        assert!(!text.contains("/usr/local"), "{unit}: the package installs into /usr");
        std::fs::write(dir.path().join(unit), text.replace("/usr/bin/tidegate", env!("CARGO_BIN_EXE_tidegate")))
            .unwrap();
    }
    let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).args(units).current_dir(dir.path()).output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stderr.is_empty(), "warnings: {}", String::from_utf8_lossy(&out.stderr));
    // The names `tidegate serve` matches its inherited sockets by.
    let socket = std::fs::read_to_string(dir.path().join("tidegate.socket")).unwrap();
    assert!(socket.contains("FileDescriptorName=proxy\n"), "{socket}");
    let admin = std::fs::read_to_string(dir.path().join("tidegate-admin.socket")).unwrap();
    assert!(admin.contains("FileDescriptorName=admin\n"), "{admin}");
    let service = std::fs::read_to_string(dir.path().join("tidegate.service")).unwrap();
    for line in ["Type=notify\n", "NotifyAccess=all\n", "User=tidegate\n", " upgrade --data-dir /var/lib/tidegate\n"] {
        assert!(service.contains(line), "tidegate.service has {line:?}");
    }
}
