// A Rust program built against the INSTALLED libkvcodec.so only
// (tests/capi/install_roundtrip.sh; `extern "C"` declarations written by hand
// from kvcodec.h, no bindgen): every method round-trips a cache (append,
// fetch, save, load, fetch again: identical bytes). With a calibration file
// as the first argument, calibrated kvtc too.
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};

#[repr(C)]
struct Tensor {
    data: *const c_void,
    dtype: c_int,
    shape: [i64; 4],
    strides: [i64; 4],
}

#[repr(C)]
struct CacheConfig {
    layer: i32,
    n_layers: i32,
    n_kv_heads: i32,
    head_dim: i32,
    rope_theta: f64,
}

#[repr(C)]
#[derive(Default, PartialEq, Debug)]
struct Stats {
    tokens: i64,
    compressed_key_bytes: u64,
    compressed_value_bytes: u64,
    fp16_key_bytes: u64,
    fp16_value_bytes: u64,
    resident_bytes: u64,
    shared_bytes: u64,
    compression_ratio: f64,
}

enum Cache {}
enum Calibration {}

#[link(name = "kvcodec")]
extern "C" {
    fn kvcodec_version() -> *const c_char;
    fn kvcodec_last_error() -> *const c_char;
    fn kvcodec_calibration_load(path: *const c_char, out: *mut *mut Calibration) -> c_int;
    fn kvcodec_calibration_free(c: *mut Calibration);
    fn kvcodec_cache_create(method: *const c_char, settings: *const c_char, config: *const CacheConfig,
                            calibration: *const Calibration, out: *mut *mut Cache) -> c_int;
    fn kvcodec_cache_load(data: *const c_void, size: usize, out: *mut *mut Cache) -> c_int;
    fn kvcodec_cache_free(c: *mut Cache);
    fn kvcodec_cache_append(c: *mut Cache, k: *const Tensor, v: *const Tensor) -> c_int;
    fn kvcodec_cache_fetch_size(c: *const Cache, dtype: c_int, bytes: *mut usize) -> c_int;
    fn kvcodec_cache_fetch(c: *mut Cache, dtype: c_int, k: *mut c_void, v: *mut c_void, capacity: usize) -> c_int;
    fn kvcodec_cache_save_size(c: *mut Cache, bytes: *mut usize) -> c_int;
    fn kvcodec_cache_save(c: *mut Cache, dst: *mut c_void, capacity: usize, written: *mut usize) -> c_int;
    fn kvcodec_cache_stats(c: *mut Cache, out: *mut Stats) -> c_int;
}

const H: i64 = 2;
const S: i64 = 256;
const D: i64 = 64;

fn check(status: c_int, what: &str) -> Result<(), String> {
    if status == 0 {
        return Ok(());
    }
    let msg = unsafe { CStr::from_ptr(kvcodec_last_error()) }.to_string_lossy().into_owned();
    Err(format!("{} failed with status {}: {}", what, status, msg))
}

fn fetch(c: *mut Cache, dtype: c_int) -> Result<(Vec<u8>, Vec<u8>), String> {
    let mut n = 0usize;
    check(unsafe { kvcodec_cache_fetch_size(c, dtype, &mut n) }, "fetch_size")?;
    let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
    check(unsafe { kvcodec_cache_fetch(c, dtype, k.as_mut_ptr() as *mut c_void, v.as_mut_ptr() as *mut c_void, n) }, "fetch")?;
    Ok((k, v))
}

fn save(c: *mut Cache) -> Result<Vec<u8>, String> {
    let mut n = 0usize;
    check(unsafe { kvcodec_cache_save_size(c, &mut n) }, "save_size")?;
    let mut bytes = vec![0u8; n];
    let mut written = 0usize;
    check(unsafe { kvcodec_cache_save(c, bytes.as_mut_ptr() as *mut c_void, n, &mut written) }, "save")?;
    if written != n {
        return Err(format!("save wrote {} of {} bytes", written, n));
    }
    Ok(bytes)
}

fn round_trip(method: &str, settings: &str, cal: *const Calibration) -> Result<f64, String> {
    let keys: Vec<f32> = (0..H * S * D).map(|i| ((i % 97) as f32 * 0.37).sin() + ((i / D) as f32 * 0.01).cos()).collect();
    let values: Vec<f32> = (0..H * S * D).map(|i| ((i % 89) as f32 * 0.23).cos() * 0.5).collect();
    let cfg = CacheConfig { layer: 2, n_layers: 6, n_kv_heads: H as i32, head_dim: D as i32, rope_theta: 10000.0 };
    let (m, s) = (CString::new(method).unwrap(), CString::new(settings).unwrap());
    let mut c: *mut Cache = std::ptr::null_mut();
    check(unsafe { kvcodec_cache_create(m.as_ptr(), s.as_ptr(), &cfg, cal, &mut c) }, "create")?;
    let tensor = |x: &Vec<f32>| Tensor { data: x.as_ptr() as *const c_void, dtype: 0, shape: [1, H, S, D], strides: [0; 4] };
    let result = (|| {
        check(unsafe { kvcodec_cache_append(c, &tensor(&keys), &tensor(&values)) }, "append")?;
        let saved = save(c)?;
        let mut loaded: *mut Cache = std::ptr::null_mut();
        check(unsafe { kvcodec_cache_load(saved.as_ptr() as *const c_void, saved.len(), &mut loaded) }, "load")?;
        let same = (|| {
            for dtype in 0..3 {
                if fetch(c, dtype)? != fetch(loaded, dtype)? {
                    return Err(format!("dtype {}: the loaded cache reconstructs other bytes", dtype));
                }
            }
            let (mut a, mut b) = (Stats::default(), Stats::default());
            check(unsafe { kvcodec_cache_stats(c, &mut a) }, "stats")?;
            check(unsafe { kvcodec_cache_stats(loaded, &mut b) }, "stats")?;
            // Counters are restored exactly; memory held is not (a loaded
            // cache holds its vectors at their exact size): at least what it
            // stores, at most what the original holds.
            let stored = b.compressed_key_bytes + b.compressed_value_bytes;
            let held_ok = b.resident_bytes >= stored && b.resident_bytes <= a.resident_bytes;
            let b_res = b.resident_bytes;
            b.resident_bytes = a.resident_bytes;
            if !held_ok || a != b || a.tokens != S || save(loaded)? != saved {
                return Err(format!("loaded state differs: {:?} vs {:?} (held {})", a, b, b_res));
            }
            Ok(a.compression_ratio)
        })();
        unsafe { kvcodec_cache_free(loaded) };
        same
    })();
    unsafe { kvcodec_cache_free(c) };
    result
}

fn main() {
    println!("kvcodec {} from Rust", unsafe { CStr::from_ptr(kvcodec_version()) }.to_string_lossy());
    let mut cases: Vec<(&str, &str)> = vec![("fp16", ""), ("int8", ""), ("int4", ""), ("kivi2", ""), ("palu", ""),
                                            ("kvtc", "mode=local;block=64")];
    let mut cal: *mut Calibration = std::ptr::null_mut();
    if let Some(path) = std::env::args().nth(1) {
        let p = CString::new(path).unwrap();
        if let Err(e) = check(unsafe { kvcodec_calibration_load(p.as_ptr(), &mut cal) }, "calibration_load") {
            eprintln!("FAIL {}", e);
            std::process::exit(1);
        }
        cases.push(("kvtc", "window=16"));
    }
    let mut failed = false;
    for (i, (method, settings)) in cases.iter().enumerate() {
        let use_cal = if i == 6 { cal as *const Calibration } else { std::ptr::null() };
        match round_trip(method, settings, use_cal) {
            Ok(ratio) => println!("{:6} {:22} ratio {:.2}", method, settings, ratio),
            Err(e) => {
                eprintln!("FAIL {} {}: {}", method, settings, e);
                failed = true;
            }
        }
    }
    unsafe { kvcodec_calibration_free(cal) };
    std::process::exit(if failed { 1 } else { 0 });
}
