//! A single-threaded async executor over the host's blocking `poll`.
//!
//! Host futures (`future-string`, `future-token`, ...) are awaited through [`HostFuture`]:
//! when one is pending, its task adds the future's pollable to the host's wait set (once,
//! under a fresh key) and yields. When no task can make progress, the executor blocks in the
//! host's `wait` and wakes the tasks whose keys come back. The instance runs on its own host
//! thread, so blocking only pauses this inferlet.

use std::cell::RefCell;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use std::collections::HashMap;

use crate::bindings::futures::{self as host, FutureString, FutureUnit, Pollable};
use crate::bindings::http::{FutureResponse, Response};
use crate::bindings::inference::{self, PassResult};
use crate::bindings::output_text::{Distribution, FutureDist, FutureToken};
use crate::bindings::types::Error;
use crate::model::Queue;

type Task = Pin<Box<dyn Future<Output = ()>>>;

thread_local! {
    /// Watched pollables of pending host futures: key, pollable, waker of the waiting task.
    static WAITING: RefCell<Vec<(u32, Rc<Pollable>, Waker)>> = RefCell::new(Vec::new());
    /// The next key for `Pollable::watch`.
    static NEXT_KEY: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// Spawned tasks not yet polled by `block_on`.
    static SPAWNED: RefCell<Vec<(Task, Arc<Flag>)>> = RefCell::new(Vec::new());
    /// Results of fused passes taken from the host and not yet claimed, by pass id.
    static RESULTS: RefCell<HashMap<u64, Vec<PassResult>>> = RefCell::new(HashMap::new());
    /// Tasks awaiting a pass: its id, its queue, the task's waker.
    static PASS_WAITERS: RefCell<Vec<(u64, Rc<Queue>, Waker)>> = RefCell::new(Vec::new());
}

/// A waker that just raises a flag: "poll this task again".
struct Flag(AtomicBool);

impl Flag {
    fn new() -> Arc<Flag> {
        Arc::new(Flag(AtomicBool::new(true)))
    }
    fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Runs `future` to completion, together with every task spawned meanwhile. Tasks still
/// unfinished when `future` completes are dropped.
pub fn block_on<T>(future: impl Future<Output = T>) -> T {
    let mut main = std::pin::pin!(future);
    let main_flag = Flag::new();
    let main_waker = Waker::from(main_flag.clone());
    let mut tasks: Vec<(Task, Arc<Flag>)> = Vec::new();
    loop {
        let mut progressed = false;
        if main_flag.take() {
            progressed = true;
            if let Poll::Ready(value) = main.as_mut().poll(&mut Context::from_waker(&main_waker)) {
                return value;
            }
        }
        tasks.extend(SPAWNED.with(|s| s.take()));
        tasks.retain_mut(|(task, flag)| {
            if !flag.take() {
                return true;
            }
            progressed = true;
            let waker = Waker::from(flag.clone());
            task.as_mut().poll(&mut Context::from_waker(&waker)).is_pending()
        });
        if !progressed {
            if PASS_WAITERS.with(|w| w.borrow().is_empty()) {
                wait_for_host();
            } else {
                wait_for_passes();
            }
        }
    }
}

/// Blocks in the host's `wait` until a watched pollable is ready; wakes its task.
fn wait_for_host() {
    assert!(WAITING.with(|w| !w.borrow().is_empty()),
            "inferlet deadlock: every task waits, and not on the host");
    let ready = host::wait();
    wake_ready(&ready);
}

/// Wakes the tasks whose pollables `wait` reported ready, and forgets those pollables.
fn wake_ready(ready: &[u32]) {
    WAITING.with(|w| {
        w.borrow_mut().retain(|(key, _, waker)| {
            let is_ready = ready.binary_search(key).is_ok();
            if is_ready {
                waker.wake_by_ref();
            }
            !is_ready
        })
    });
}

/// Blocks until a result of an awaited pass arrives. With no host future pending, that is
/// one host call, a blocking `take` — a decode step costs `execute` + `take`. Otherwise the
/// queues' `results-ready` pollables join the host's wait set and `wait` serves both.
fn wait_for_passes() {
    let mut queues: Vec<Rc<Queue>> = Vec::new();
    PASS_WAITERS.with(|w| {
        for (_, queue, _) in w.borrow().iter() {
            if !queues.iter().any(|q| Rc::ptr_eq(q, queue)) {
                queues.push(queue.clone());
            }
        }
    });
    if WAITING.with(|w| w.borrow().is_empty()) {
        let got = inference::take(queues[0].raw(), true);
        assert!(!got.is_empty(), "inferlet deadlock: a pass is awaited but none is in flight on its queue");
        distribute(got);
        return;
    }
    let keys: Vec<(u32, Rc<Queue>)> = queues.into_iter().map(|queue| {
        let key = NEXT_KEY.with(|k| k.replace(k.get().wrapping_add(1)));
        queue.results_pollable().watch(key);
        (key, queue)
    }).collect();
    let ready = host::wait();
    wake_ready(&ready);
    for (key, queue) in keys {
        if ready.binary_search(&key).is_ok() {
            distribute(inference::take(queue.raw(), false));
        }
    }
}

/// Files taken results by pass and wakes the tasks awaiting them.
fn distribute(results: Vec<PassResult>) {
    RESULTS.with(|r| {
        let mut r = r.borrow_mut();
        for result in results {
            r.entry(result.pass).or_default().push(result);
        }
    });
    PASS_WAITERS.with(|w| {
        w.borrow_mut().retain(|(id, _, waker)| {
            let arrived = RESULTS.with(|r| r.borrow().contains_key(id));
            if arrived {
                waker.wake_by_ref();
            }
            !arrived
        })
    });
}

/// Results of pass `id` taken so far and not yet claimed (a run has one per take).
pub(crate) fn claim(id: u64) -> Option<Vec<PassResult>> {
    RESULTS.with(|r| r.borrow_mut().remove(&id))
}

/// The next results of pass `id` (a run's progress, or a pass's one final result).
pub(crate) struct PassWait {
    pub id: u64,
    pub queue: Rc<Queue>,
}

impl Future for PassWait {
    type Output = Vec<PassResult>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Vec<PassResult>> {
        if let Some(results) = claim(self.id) {
            return Poll::Ready(results);
        }
        PASS_WAITERS.with(|w| {
            let mut waiters = w.borrow_mut();
            match waiters.iter_mut().find(|(id, _, _)| *id == self.id) {
                Some(entry) => entry.2 = cx.waker().clone(),
                None => waiters.push((self.id, self.queue.clone(), cx.waker().clone())),
            }
        });
        Poll::Pending
    }
}

impl Drop for PassWait {
    fn drop(&mut self) {
        PASS_WAITERS.with(|w| w.borrow_mut().retain(|(id, _, _)| *id != self.id));
    }
}

/// Starts `future` as a concurrent task of the running `block_on`; await the handle for
/// its output.
pub fn spawn<T: 'static>(future: impl Future<Output = T> + 'static) -> JoinHandle<T> {
    let slot = Rc::new(RefCell::new(Slot { value: None, waker: None }));
    let writer = slot.clone();
    let task: Task = Box::pin(async move {
        let value = future.await;
        let mut slot = writer.borrow_mut();
        slot.value = Some(value);
        if let Some(waker) = slot.waker.take() {
            waker.wake();
        }
    });
    SPAWNED.with(|s| s.borrow_mut().push((task, Flag::new())));
    JoinHandle { slot }
}

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
}

/// The output of a spawned task, as a future.
pub struct JoinHandle<T> {
    slot: Rc<RefCell<Slot<T>>>,
}

impl<T> Future for JoinHandle<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let mut slot = self.slot.borrow_mut();
        match slot.value.take() {
            Some(value) => Poll::Ready(value),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Awaits all `futures` concurrently; their outputs in order.
pub async fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                if let Poll::Ready(value) = future.as_mut().poll(cx) {
                    *output = Some(value);
                }
            }
        }
        if outputs.iter().all(Option::is_some) { Poll::Ready(()) } else { Poll::Pending }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

/// A host future resource: a pollable to wait on and a non-blocking `get`.
pub trait HostResult: Unpin {
    type Output;
    fn subscribe(&self) -> Pollable;
    fn get(&self) -> Option<Self::Output>;
}

/// Awaits a host future resource (`.await` on the resource goes through this).
pub struct HostFuture<R> {
    // Declared before `resource`: a pollable is dropped before the future it watches.
    pollable: Option<Rc<Pollable>>,
    resource: R,
}

impl<R: HostResult> Future for HostFuture<R> {
    type Output = R::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<R::Output> {
        if let Some(value) = self.resource.get() {
            return Poll::Ready(value);
        }
        let pollable = match &self.pollable {
            Some(pollable) => pollable.clone(),
            None => {
                let pollable = Rc::new(self.resource.subscribe());
                self.pollable = Some(pollable.clone());
                pollable
            }
        };
        WAITING.with(|w| {
            let mut waiting = w.borrow_mut();
            match waiting.iter_mut().find(|(_, p, _)| Rc::ptr_eq(p, &pollable)) {
                Some(entry) => entry.2 = cx.waker().clone(),
                None => {
                    let key = NEXT_KEY.with(|k| k.replace(k.get().wrapping_add(1)));
                    pollable.watch(key);
                    waiting.push((key, pollable, cx.waker().clone()));
                }
            }
        });
        Poll::Pending
    }
}

impl<R> Drop for HostFuture<R> {
    fn drop(&mut self) {
        if let Some(pollable) = &self.pollable {
            WAITING.with(|w| w.borrow_mut().retain(|(_, p, _)| !Rc::ptr_eq(p, pollable)));
        }
    }
}

macro_rules! host_result {
    ($resource:ty, $output:ty) => {
        impl HostResult for $resource {
            type Output = $output;
            fn subscribe(&self) -> Pollable {
                <$resource>::subscribe(self)
            }
            fn get(&self) -> Option<$output> {
                <$resource>::get(self)
            }
        }
        impl IntoFuture for $resource {
            type Output = $output;
            type IntoFuture = HostFuture<$resource>;
            fn into_future(self) -> HostFuture<$resource> {
                HostFuture { pollable: None, resource: self }
            }
        }
    };
}

host_result!(FutureUnit, Result<(), Error>);
host_result!(FutureString, String);
host_result!(FutureResponse, Result<Response, Error>);
host_result!(FutureDist, Result<Distribution, Error>);
host_result!(FutureToken, Result<u32, Error>);
