//! Live progress: a bar on a terminal (bytes done, rate, ETA, sessions busy), plain lines otherwise.

use std::io::IsTerminal;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use pghydrate::report::human_bytes;
use pghydrate::warm::Counters;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, ValueEnum)]
pub enum Style {
    Auto,
    Bar,
    Lines,
    None,
}

pub struct Display {
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Display {
    pub async fn finish(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

/// `already`: bytes done by earlier calls (a resumed run), shown as done.
pub fn start(style: Style, interval: Duration, counters: Arc<Counters>, already: u64) -> Display {
    let style = match style {
        Style::Auto if std::io::stderr().is_terminal() => Style::Bar,
        Style::Auto => Style::Lines,
        s => s,
    };
    let (tx, mut rx) = oneshot::channel::<()>();
    let task = match style {
        Style::None | Style::Auto => None,
        Style::Bar => Some(tokio::spawn(async move {
            let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr_with_hz(5));
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
                )
                .expect("template"),
            );
            loop {
                let planned = counters.planned_bytes.load(Ordering::Relaxed);
                bar.set_length(planned + already);
                bar.set_position(counters.done_bytes.load(Ordering::Relaxed) + already);
                bar.set_message(format!(
                    "{}/{} sessions busy",
                    counters.busy_sessions.load(Ordering::Relaxed),
                    counters.sessions.load(Ordering::Relaxed)
                ));
                tokio::select! {
                    _ = &mut rx => break,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
            bar.finish_and_clear();
        })),
        Style::Lines => Some(tokio::spawn(async move {
            let started = Instant::now();
            loop {
                tokio::select! {
                    _ = &mut rx => break,
                    _ = tokio::time::sleep(interval) => {}
                }
                let planned = counters.planned_bytes.load(Ordering::Relaxed);
                let done = counters.done_bytes.load(Ordering::Relaxed);
                if planned == 0 {
                    continue;
                }
                let secs = started.elapsed().as_secs_f64().max(0.001);
                let rate = done as f64 / secs;
                let eta = if rate > 0.0 {
                    humantime::format_duration(Duration::from_secs(((planned - done) as f64 / rate) as u64)).to_string()
                } else {
                    "unknown".into()
                };
                eprintln!(
                    "progress: {:.1}% {} of {}, {}/s, ETA {eta}, {}/{} sessions busy",
                    (done + already) as f64 * 100.0 / (planned + already) as f64,
                    human_bytes(done + already),
                    human_bytes(planned + already),
                    human_bytes(rate as u64),
                    counters.busy_sessions.load(Ordering::Relaxed),
                    counters.sessions.load(Ordering::Relaxed)
                );
            }
        })),
    };
    Display { stop: Some(tx), task }
}
